"""The managed GenRM judge (relax_core/judge.py): a tiny random judge engine process Relax starts, scores
through its router, counts garbage and a judge that is down, and is restarted after its process is killed."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import relax_rewards
from relax_core.config import RelaxConfig
from relax_core.engines.server_process import group_members
from relax_core.judge import start_judge
from relax_models.ports import free_port
from relax_rewards import RewardExecutor, RewardItem
from relax_rewards.config import JudgeConfig, RewardConfig
from relax_rewards.preflight import check_reward_config

ITEMS = [RewardItem(f"s{i}", str(i), "3", {"question": "1+2?"}, group_id=i) for i in range(8)]


def score(url: str, **parser: str) -> list[tuple[float, dict[str, float]]]:
    """genrm's outcomes for ITEMS, judged at ``url`` (in-process calls, run concurrently)."""
    kwargs = {
        "url": url,
        "template": "{question} {reference} {response}",
        "sampling_params": {"max_new_tokens": 4},
    }
    cfg = RewardConfig(name="genrm", num_workers=0, kwargs=kwargs | parser)
    with RewardExecutor(cfg) as ex:
        outcomes = ex.score(ITEMS)
    assert all(o.error is None for o in outcomes), outcomes
    return [(o.reward, o.extras) for o in outcomes]


def test_managed_judge_scores_counts_garbage_and_restarts(tmp_path: Path) -> None:
    cfg = RelaxConfig(output_dir=str(tmp_path))
    cfg.reward = RewardConfig(
        name="genrm", judge=JudgeConfig(model="tiny_qwen3", health_interval_s=0.2, wait_s=0.5)
    )
    judge = start_judge(cfg)
    assert judge is not None
    url = cfg.reward.kwargs["url"]
    pid = judge.engines[0].process.pid
    try:
        # a random judge answers garbage: no verdict, scored 0 and counted
        garbage = score(url)
        assert [r for r, _ in garbage] == [0.0] * 8
        assert all(ex == {"judge_parse_errors": 1.0, "judge_errors": 0.0} for _, ex in garbage)
        # a parser that takes any reply as the verdict "" proves the path from engine to a score of 1
        assert [r for r, _ in score(url, verdict_pattern="^", correct_verdict="")] == [1.0] * 8

        os.killpg(pid, signal.SIGKILL)
        down = score(url, verdict_pattern="^", correct_verdict="")
        assert all(r == 0.0 and ex["judge_errors"] == 1.0 for r, ex in down)  # down: a counted 0
        deadline = time.monotonic() + 120
        while not (judge.restarts and judge.router.keys(routable_only=True)):
            assert time.monotonic() < deadline, "the killed judge engine was not restarted"
            time.sleep(0.2)
        assert [r for r, _ in score(url, verdict_pattern="^", correct_verdict="")] == [1.0] * 8
        restarted = judge.engines[0].process.pid
        assert restarted != pid
    finally:
        judge.stop()
    assert not group_members(restarted)


def test_slow_or_absent_judge_scores_a_counted_zero(http_server) -> None:
    genrm = relax_rewards.get("genrm")

    def slow(body: dict) -> tuple[int, dict]:
        time.sleep(0.5)
        return 200, {"text": "1"}

    http_server.handler = slow
    counted = {"score": 0.0, "judge_parse_errors": 0.0, "judge_errors": 1.0}
    assert genrm("3", "3", url=http_server.url, timeout_s=0.1) == counted
    assert genrm("3", "3", url=f"http://127.0.0.1:{free_port()}", timeout_s=0.2) == counted
    with pytest.raises(ValueError, match="reward.kwargs.verdict_pattern is not a regular expression"):
        check_reward_config(
            RewardConfig(name="genrm", kwargs={"judge": "x", "verdict_pattern": "("}), "label"
        )
