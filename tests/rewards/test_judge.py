"""The managed GenRM judge (relax_core/rollout/judge.py): a tiny random judge engine Relax places in Ray, scores
through its router, counts garbage and a judge that is down, and is restarted after its server is killed,
after it hangs and after its actor is lost."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from tiers import heavy

import relax_rewards
from relax_core.config.schema import InProcessClusterConfig, RelaxConfig
from relax_core.engines.server_process import group_members
from relax_core.engines.vllm import vllm_unavailable_reason
from relax_core.rollout.judge import start_judge
from relax_core.runtime import handles
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
        "timeout_s": 60.0,  # a slow host's judge is still an answer here; the timeout has its own test
    }
    cfg = RewardConfig(name="genrm", num_workers=0, kwargs=kwargs | parser)
    with RewardExecutor(cfg) as ex:
        outcomes = ex.score(ITEMS)
    assert all(o.error is None for o in outcomes), outcomes
    return [(o.reward, o.extras) for o in outcomes]


@pytest.fixture
@heavy("starts a local Ray")
def ray_cluster():
    """A local Ray cluster of 2 logical CPUs, for the judge's placement group."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_placed_judge_scores_counts_garbage_and_restarts(tmp_path: Path, ray_cluster) -> None:
    """The judge engine is a Ray actor in its own placement group: Ray counts its CPUs, its server is
    restarted when killed and when hung, and the actor is replaced when it is killed."""
    ray = ray_cluster
    cfg = RelaxConfig(output_dir=str(tmp_path))
    cfg.reward = RewardConfig(
        name="genrm",
        judge=JudgeConfig(model="tiny_qwen3", health_interval_s=0.2, wait_s=0.5, hang_timeout_s=2.0),
    )
    judge = start_judge(cfg)
    assert judge is not None
    url = cfg.reward.kwargs["url"]
    server_pids = []

    def server_pid() -> int:
        server_pids.append(handles.get(judge.group.actors[0].pid.remote()))
        return server_pids[-1]

    pid = server_pid()
    try:
        assert ray.available_resources()["CPU"] == 1.5  # the judge's bundle holds reward.judge.num_cpus
        # a CPU judge sees no GPU of its node: it never shares a role's
        assert b"\0CUDA_VISIBLE_DEVICES=\0" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
        # a random judge answers garbage: no verdict, scored 0 and counted
        garbage = score(url)
        assert [r for r, _ in garbage] == [0.0] * 8
        assert all(ex == {"judge_parse_errors": 1.0, "judge_errors": 0.0} for _, ex in garbage)
        # a parser that takes any reply as the verdict "" proves the path from engine to a score of 1
        assert [r for r, _ in score(url, verdict_pattern="^", correct_verdict="")] == [1.0] * 8

        os.killpg(pid, signal.SIGKILL)
        down = score(url, verdict_pattern="^", correct_verdict="")
        assert all(r == 0.0 and ex["judge_errors"] == 1.0 for r, ex in down)  # down: a counted 0
        wait_until_serving_again(judge, restarts=1)
        assert [r for r, _ in score(url, verdict_pattern="^", correct_verdict="")] == [1.0] * 8
        restarted = server_pid()
        assert restarted != pid

        os.killpg(restarted, signal.SIGSTOP)  # alive, but answers nothing: hung
        wait_until_serving_again(judge, restarts=2)
        assert not group_members(restarted)  # the hung engine was killed, not left stopped

        # the engine's actor is lost (as with its node): a new actor in the same bundle, and its old
        # server follows the actor out (--parent-pid)
        ray.kill(judge.group.actors[0], no_restart=True)
        wait_until_serving_again(judge, restarts=3)
        assert judge.metrics() == {"judge/restarts": 3.0}
        assert [r for r, _ in score(url, verdict_pattern="^", correct_verdict="")] == [1.0] * 8
        assert server_pid() != server_pids[-2]
        wait_for(lambda: not group_members(server_pids[-2]), "the lost actor's server to exit")
    finally:
        judge.stop()
    assert not any(group_members(p) for p in server_pids)
    wait_for(lambda: ray.available_resources().get("CPU") == 2.0, "the judge's placement group to go")


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"waited 60 s for {what}"
        time.sleep(0.2)


VLLM_REASON = vllm_unavailable_reason()


@pytest.fixture
@heavy("starts a vLLM judge server")
def vllm_judge(tmp_path: Path):
    """``reward.judge.engine=vllm`` with ``cluster=in_process``, started: (config, judge)."""
    cfg = RelaxConfig(output_dir=str(tmp_path), cluster=InProcessClusterConfig())
    cfg.reward = RewardConfig(name="genrm", judge=JudgeConfig(model="tiny_qwen3", engine="vllm"))
    judge = start_judge(cfg)
    assert judge is not None
    yield cfg, judge
    judge.stop()


# CI installs vLLM (tests/run.sh): there a missing install is a failure, not a skip
@pytest.mark.skipif(
    VLLM_REASON is not None and not os.environ.get("RELAX_REQUIRE_VLLM"), reason=str(VLLM_REASON)
)
def test_vllm_judge_engine_scores_through_the_router(vllm_judge) -> None:
    """``reward.judge.engine=vllm``: the judge engine is vLLM's server in vLLM's interpreter, taking the
    judge's text prompt and answering text: garbage is a counted 0, a verdict scores. With
    ``cluster=in_process`` the engine's role is an object in this process."""
    cfg, judge = vllm_judge
    assert "relax_core.engines.vllm_server" in judge.group.actors[0].role.launch.command
    url = cfg.reward.kwargs["url"]
    garbage = score(url)
    assert all(r == 0.0 and ex == {"judge_parse_errors": 1.0, "judge_errors": 0.0} for r, ex in garbage)
    assert [r for r, _ in score(url, verdict_pattern="^", correct_verdict="")] == [1.0] * 8


def wait_until_serving_again(judge, restarts: int) -> None:
    deadline = time.monotonic() + 120
    while not (judge.restarts >= restarts and judge.router.keys(routable_only=True)):
        assert time.monotonic() < deadline, f"the judge engine was not restarted (restart {restarts})"
        time.sleep(0.2)


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


def test_an_eval_set_genrm_without_a_judge_asks_the_runs() -> None:
    from relax_core.evaluation.evaluator import with_run_judge

    run = RewardConfig(
        name="genrm", kwargs={"url": "http://127.0.0.1:9"}, judge=JudgeConfig(model="tiny_qwen3")
    )
    assert with_run_judge(RewardConfig(name="genrm"), run).kwargs["url"] == "http://127.0.0.1:9"
    own = RewardConfig(name="genrm", kwargs={"url": "http://127.0.0.1:8"})
    assert with_run_judge(own, run) is own  # a set that names its judge keeps it
    digits = RewardConfig(name="digits")
    assert with_run_judge(digits, run) is digits
    assert with_run_judge(RewardConfig(name="genrm"), RewardConfig(name="digits")).kwargs == {}
