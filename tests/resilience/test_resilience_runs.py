"""End-to-end runs with real Ray actors: export, notifications, checkpoints, kill -9 of role processes.

The kills are real SIGKILLs of the role actors' processes while the run is going; the HealthManager must
restart the rollout engine in place and restart everything from the last checkpoint when the Actor dies.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest
import torch
from resilience_helpers import (
    TINY_RUN,
    TINY_RUN_IN_PROCESS,
    actor_pid,
    compose,
    read_metrics,
    wait_for_row,
    wait_for_step,
)

from relax_launch.run import run_experiment

pytestmark = pytest.mark.slow


def _steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir)]


def test_run_exports_a_loadable_hf_model_checkpoints_and_notifies(tmp_path: Path) -> None:
    notify = tmp_path / "notify.jsonl"
    run_dir = tmp_path / "run"
    cfg = compose(
        [
            *TINY_RUN_IN_PROCESS,  # the export on Ray: test_actor_killed_after_the_last_step_still_exports_...
            "trainer.total_steps=4",
            "trainer.save_every=2",
            f"logger.notify_urls=[relaxfile://{notify}]",
        ],
        run_dir,
    )
    summary = run_experiment(cfg)

    assert summary["status"] == "finished" and summary["steps"] == 4
    assert _steps(run_dir) == [0, 1, 2, 3, 4]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000002", "step_000004"]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run_dir / "final_model")
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final_model")
    assert any(p.name.endswith(".safetensors") for p in (run_dir / "final_model").iterdir())
    ids = tokenizer("123", return_tensors="pt").input_ids
    assert model(input_ids=ids).logits.shape[-1] == model.config.vocab_size
    # the exported weights are the trained ones, not the initial ones
    ckpt = torch.load(run_dir / "checkpoints/step_000004/actor/backend.pt", weights_only=False)["model"]
    exported = model.state_dict()
    for name, tensor in ckpt.items():
        assert torch.equal(exported[name], tensor), name

    kinds = [json.loads(line)["type"] for line in notify.read_text().splitlines()]
    assert kinds == ["info", "success"]


def _kill_when(run_dir: Path, step: int, role: str, log: list) -> threading.Thread:
    def target() -> None:
        wait_for_step(run_dir, step)
        pid = actor_pid(role)
        os.kill(pid, signal.SIGKILL)
        log.append((role, pid, max(_steps(run_dir))))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_killed_rollout_restarts_in_place_and_killed_actor_resumes_from_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    notify = tmp_path / "notify.jsonl"
    cfg = compose(
        [
            *TINY_RUN,
            "mode.fuse_rollout=false",  # the engine in a process of its own, so that it can die alone
            # steps take ~0.05-0.09 s: enough after the Actor's kill trigger (step 5) that the kill lands
            # mid-run, not in the final export after the last step; 7 steps were too few
            "trainer.total_steps=30",
            "trainer.save_every=2",
            "trainer.heartbeat_interval_s=1",
            f"logger.notify_urls=[relaxfile://{notify}]",
        ],
        run_dir,
    )
    kills: list = []
    first = _kill_when(run_dir, 2, "rollout-0", kills)

    def then_actor() -> None:
        first.join()
        # the Actor dies once the engine's death is handled: two deaths found in one recovery are one global
        # restart and no restart in place (CI saw both found at one step when the engine's kill came late)
        handled = wait_for_row(
            run_dir, lambda r: r.get("health/role_restarts", 0) >= 1, "the engine's restart"
        )
        _kill_when(run_dir, max(5, handled["step"] + 1), "actor-0", kills).join()

    second = threading.Thread(target=then_actor, daemon=True)
    second.start()
    summary = run_experiment(cfg)
    second.join(timeout=5)

    assert [k[0] for k in kills] == ["rollout-0", "actor-0"], kills
    assert summary["status"] == "finished"
    # every step exactly once, in order, although steps after the checkpoint ran twice
    assert _steps(run_dir) == list(range(0, 31))
    records = read_metrics(run_dir)
    last = records[-1]
    assert last["health/role_restarts"] >= 1  # the rollout engine, restarted in place
    assert last["health/global_restarts"] == 1  # the Actor: everything restarted from a checkpoint
    # whether the kill landed inside a step (then retried) or between steps (engine replaced before the next
    # one) depends on timing; either way no step was skipped or repeated (asserted above)
    assert summary["health_global_restarts"] == 1
    assert (run_dir / "final_model" / "config.json").is_file()


def test_killed_fused_actor_and_engine_process_resumes_from_checkpoint(tmp_path: Path) -> None:
    """Colocate's default puts the Actor and its engine in one process: killing it loses the Actor, so the
    run restarts every role from the last checkpoint and still runs every step once."""
    run_dir = tmp_path / "run"
    # steps of this tiny run take ~0.05 s: enough of them after the kill's trigger that it lands mid-run
    cfg = compose([*TINY_RUN, "trainer.total_steps=30", "trainer.save_every=2"], run_dir)
    kills: list = []
    killer = _kill_when(run_dir, 3, "actor-rollout-0", kills)
    summary = run_experiment(cfg)
    killer.join(timeout=5)

    assert [k[0] for k in kills] == ["actor-rollout-0"], kills
    assert summary["status"] == "finished" and summary["health_global_restarts"] == 1
    assert _steps(run_dir) == list(range(0, 31))


def test_actor_killed_after_the_last_step_still_exports_the_trained_model(tmp_path: Path) -> None:
    """A death after the last step (in the final export or eval) restarts every role from the final step's
    checkpoint and exports again: the run finishes with the trained weights, no step run twice."""
    import time

    run_dir = tmp_path / "run"
    cfg = compose([*TINY_RUN, "trainer.total_steps=4", "trainer.save_every=2"], run_dir)
    final_ckpt = run_dir / "checkpoints/step_000004"
    kills: list = []

    def kill_after_the_final_checkpoint() -> None:
        # looked up as soon as the actor exists: the kill must follow the checkpoint closely, and on a fast
        # host the 4 steps are over before a poll of the metrics file sees step 1
        pid = actor_pid("actor-rollout-0")
        while not final_ckpt.exists():
            time.sleep(0.005)
        os.kill(pid, signal.SIGKILL)
        kills.append(pid)

    killer = threading.Thread(target=kill_after_the_final_checkpoint, daemon=True)
    killer.start()
    summary = run_experiment(cfg)
    killer.join(timeout=5)

    assert len(kills) == 1
    assert summary["status"] == "finished" and summary["health_global_restarts"] == 1, summary
    assert _steps(run_dir) == [0, 1, 2, 3, 4]
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(run_dir / "final_model").state_dict()
    trained = torch.load(final_ckpt / "actor/backend.pt", weights_only=False)["model"]
    for name, tensor in trained.items():
        assert torch.equal(exported[name], tensor), name


def test_run_gives_up_after_max_global_restarts_with_a_report(tmp_path: Path) -> None:
    from relax_core.health import RunFailedError

    run_dir = tmp_path / "run"
    notify = tmp_path / "notify.jsonl"
    cfg = compose(
        [
            *TINY_RUN,
            "trainer.sft_warmup_steps=0",
            "trainer.total_steps=50",
            "trainer.save_every=0",
            "cluster.max_global_restarts=0",
            f"logger.notify_urls=[relaxfile://{notify}]",
        ],
        run_dir,
    )
    kills: list = []
    _kill_when(run_dir, 1, "actor-rollout-0", kills)  # the Actor's process (it holds the engine too)
    with pytest.raises(RunFailedError, match="actor-0"):
        run_experiment(cfg)

    report = json.loads((run_dir / "failure_report.json").read_text())
    kinds = [(e["kind"], e["role"]) for e in report["events"]]
    assert ("dead", "actor") in kinds and ("give_up", "run") in kinds
    assert max(_steps(run_dir)) < 50
    records = [json.loads(line) for line in notify.read_text().splitlines()]
    assert [r["type"] for r in records] == ["info", "failure"]
    assert "actor-0" in records[-1]["body"]


def test_ppo_resumed_from_a_checkpoint_continues_like_the_uninterrupted_run(tmp_path: Path) -> None:
    """The Critic (value model, optimizer, warm-up count) is part of a checkpoint: resuming PPO at step 3
    gives the uninterrupted run's rewards and value losses for steps 4-6."""
    common = [
        *TINY_RUN_IN_PROCESS,
        "algorithm=ppo",
        "algorithm.critic.warmup_steps=2",
        "trainer.total_steps=6",
    ]
    straight = tmp_path / "straight"
    run_experiment(compose([*common, "trainer.save_every=3"], straight))
    ckpt = straight / "checkpoints" / "step_000003"
    assert (ckpt / "critic" / "backend.pt").is_file()

    resumed = tmp_path / "resumed"
    summary = run_experiment(compose([*common, f"trainer.resume={ckpt}"], resumed))
    assert summary["status"] == "finished"

    def late(run_dir: Path) -> list[float]:
        rows = [r for r in read_metrics(run_dir) if r["step"] > 3]
        return [r["reward/mean"] for r in rows] + [r["critic/vf_loss"] for r in rows]

    assert len(late(straight)) == 6
    assert late(resumed) == pytest.approx(late(straight), rel=1e-5)
