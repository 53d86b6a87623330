"""A custom reward that times out on a preflight probe stops the launch in one line naming the reward, the
timeout and the key that raises it: a run would spend that timeout on its samples, the evaluation before RL
first. The probes are the dataset's first rows, or a synthetic task's first draws."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax_core.errors import RelaxUserError
from relax_core.preflight.validation import validate
from relax_rewards.config import RewardConfig
from relax_rewards.preflight import check_reward_config
from tests.core.conftest import typed_config

# sleeps past the tests' 0.2 s timeout on the labels it is told to (all of them by default)
SLOW = (
    "import time\n"
    "def score(response, label, metadata=None, slow=None):\n"
    "    if slow is None or label in slow:\n"
    "        time.sleep(2)\n"
    "    return 1.0\n"
)


def slow_reward(tmp_path: Path) -> str:
    (tmp_path / "slow.py").write_text(SLOW)
    return f"{tmp_path / 'slow.py'}:score"


def test_reward_that_hangs_on_the_synthetic_task_stops_the_launch(tmp_path: Path) -> None:
    """Through the launcher's validation, with the default generated digits task (no train file)."""
    target = slow_reward(tmp_path)
    cfg = typed_config(f"reward._target_={target}", "reward.timeout_s=0.2", "reward.num_workers=0")
    with pytest.raises(RelaxUserError) as err:
        validate(cfg)
    assert str(err.value) == (
        f"reward._target_='{target}' timed out (reward.timeout_s=0.2) on 4 of 4 probes (the first rows of "
        "data.synthetic=digits, each answered with its own label): raise reward.timeout_s if it is only slow"
    )


def test_one_timed_out_probe_is_enough(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(3)))
    cfg = RewardConfig(_target_=slow_reward(tmp_path), kwargs={"slow": ["2"]}, timeout_s=0.2, num_workers=0)
    with pytest.raises(
        ValueError,
        match=r"timed out \(reward.timeout_s=0.2\) on 1 of 3 probes \(the first rows of .*rows.jsonl",
    ):
        check_reward_config(cfg, "answer", str(rows))
    cfg.kwargs = {"slow": []}  # the same reward within its timeout passes
    check_reward_config(cfg, "answer", str(rows))
