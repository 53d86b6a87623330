"""A reward that cannot score stops the run at start with one line: missing judge/service URL, a URL nobody
answers on, a dataset without the label column the reward scores against."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from relax_core.config.schema import RelaxConfig
from relax_core.errors import RelaxUserError
from relax_core.preflight.validation import validate
from relax_rewards.config import RewardConfig
from relax_rewards.preflight import check_reward_config

ROOT = Path(__file__).resolve().parents[2]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nobody listens once the socket is closed


def test_rewards_that_need_a_url_name_the_key(http_server) -> None:
    with pytest.raises(ValueError, match=r"reward=genrm needs reward.kwargs.url or reward.kwargs.judge"):
        check_reward_config(RewardConfig(name="genrm"), "label")
    with pytest.raises(ValueError, match=r"reward=remote needs reward.kwargs.url"):
        check_reward_config(RewardConfig(name="remote"), "label")
    down = f"http://127.0.0.1:{closed_port()}/score"
    with pytest.raises(ValueError, match=rf"reward.kwargs.url='{down}' is not reachable"):
        check_reward_config(RewardConfig(name="remote", kwargs={"url": down}), "label")
    with pytest.raises(ValueError, match="not an http"):
        check_reward_config(RewardConfig(name="genrm", kwargs={"url": "judge:30000"}), "label")
    check_reward_config(RewardConfig(name="remote", kwargs={"url": http_server.url}), None)
    check_reward_config(RewardConfig(name="genrm", kwargs={"url": http_server.url}), "label")
    assert http_server.requests == []  # a TCP connect only: the service sees no request


def test_rewards_that_score_against_a_label_need_the_column(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "1+1", "answer": "2"}) + "\n")
    with pytest.raises(
        ValueError, match=r"reward=math scores against a reference answer: set data.label_key"
    ):
        check_reward_config(RewardConfig(name="math"), None)
    with pytest.raises(
        ValueError,
        match=r"data.label_key='label', which .*rows.jsonl does not have \(its columns: answer, prompt\)",
    ):
        check_reward_config(RewardConfig(name="math"), "label", str(rows))
    check_reward_config(RewardConfig(name="math"), "answer", str(rows))
    check_reward_config(RewardConfig(name="math"), "answer.value", str(rows))  # nested: the top level exists
    check_reward_config(RewardConfig(name="ifeval"), None, str(rows))  # instructions come from metadata


def test_validation_raises_one_user_error(tmp_path: Path) -> None:
    cfg = RelaxConfig()
    cfg.reward.name = "genrm"
    with pytest.raises(RelaxUserError, match="reward=genrm needs"):
        validate(cfg)


def test_launch_stops_at_start_with_one_line(tmp_path: Path, relax_launch_cmd: list[str]) -> None:
    run = subprocess.run(
        [*relax_launch_cmd, f"hydra.run.dir={tmp_path}", "logger=jsonl", "reward=genrm"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1] == (
        "error: reward=genrm needs reward.kwargs.url or reward.kwargs.judge "
        "(e.g. reward.judge.path=<HF folder> or reward.kwargs.url=http://host:port)"
    )


def test_math_verify_timeouts_print_nothing() -> None:
    """In a plain process (no pytest log capture): the timeout notices are dropped, other warnings show."""
    script = (
        "import logging, relax_rewards._mathverify\n"
        "logging.getLogger('math_verify.parser').warning('Timeout during parsing: \\\\sum x')\n"
        "logging.getLogger('math_verify.grader').warning('Timeout during comparison')\n"
        "logging.getLogger('math_verify.parser').warning('something else')\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "" and run.stderr.strip() == "something else"


def probe_rows(tmp_path: Path) -> Path:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(2)))
    return rows


@pytest.mark.parametrize(
    ("source", "cause"),
    [
        (
            "def score(response, label, metadata=None):\n    raise ValueError('no grader')\n",
            r"cannot score: it failed \(ValueError: no grader\) on all 2 probes \(the first rows of .*rows.jsonl",
        ),
        (
            "def score(response, label, metadata=None):\n    return 'yes'\n",
            r"cannot score: it failed \(reward returned str, expected a number or a dict\) on all 2 probes",
        ),
        ("def score():\n    return 1.0\n", r"cannot be called as score\(response, label, metadata"),
        ("import no_such_module_xyz\n", r"cannot be loaded: .*no_such_module_xyz"),
    ],
)
def test_custom_reward_that_cannot_score_stops_before_the_first_step(
    tmp_path: Path, source: str, cause: str
) -> None:
    rows = probe_rows(tmp_path)
    (tmp_path / "r.py").write_text(source)
    cfg = RewardConfig(_target_=f"{tmp_path / 'r.py'}:score", num_workers=0)
    with pytest.raises(ValueError, match=rf"^reward._target_='.*r.py:score' {cause}") as err:
        check_reward_config(cfg, "answer", str(rows))
    assert "\n" not in str(err.value)


def test_custom_reward_that_scores_some_probes_passes(tmp_path: Path) -> None:
    # once, not per case above: the same rows and reward each time, and its probe starts a worker process
    rows = probe_rows(tmp_path)
    (tmp_path / "some.py").write_text(
        "def score(response, label, metadata=None):\n    return 1.0 / (int(label) - 1)\n"
    )
    check_reward_config(RewardConfig(_target_=f"{tmp_path / 'some.py'}:score"), "answer", str(rows))
