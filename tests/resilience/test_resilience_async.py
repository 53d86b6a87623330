"""mode=async under real SIGKILLs: every role's process (and the data bus's) is killed in turn while steps
are in flight; the run finishes every step exactly once and its sample accounting balances."""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

import pytest
from resilience_helpers import TINY_RUN, actor_pid, compose, read_metrics, recovered, wait_for_step

from relax_core.databus.transferqueue import CONTROLLER, CONTROLLER_NAMESPACE, STORAGE_UNIT
from relax_launch.run import run_experiment

pytestmark = pytest.mark.slow

STEP_SAMPLES = 4 * 4  # TINY_RUN: 4 prompts x 4 samples
# steps after the last kill's trigger, so that on a fast host (async steps of ~0.1 s) it lands mid-run
SHORT_RUN = 12
# (after this step is logged, kill this process): a rollout engine, the Reference, ActorFwd, the advantage
# estimator and the data bus are replaced in place; the Critic's death (its optimizer state lives only in
# its process) and the Actor's restart everything from a checkpoint
KILLS = [
    (1, "rollout-0"),
    (2, "reference-0"),
    (3, "actor_fwd-0"),
    (4, "advantages-0"),
    (5, "databus"),
    (6, "critic-0"),
    (7, "actor-0"),
]
TOTAL = 28  # room for the seven kills: each waits until the run has recovered from the one before


def run_killing(cfg, run_dir: Path, kills: list[tuple[int, str, str | None]]) -> tuple[dict, list[int]]:
    """Run ``cfg`` while a thread SIGKILLs each ``(step, actor name, namespace)`` in turn, once that step is
    logged; returns the run's summary and, for each kill, the last step logged before it. Each kill waits
    until a row counts more recoveries than the last row before the kill ahead of it: two deaths found in
    one recovery would be counted as one (and the Actor's global restart would hide the other). One kill
    may count two recoveries (a step retried in place whose Actor had already updated, then the restart
    from the checkpoint), so the count to wait for is read, not assumed."""
    killed: list[str] = []
    logged_before: list[int] = []
    errors: list[BaseException] = []

    def kill_in_turn() -> None:
        try:
            seen = -1  # recoveries counted by the last row before the previous kill
            for step, name, namespace in kills:
                wait_for_step(run_dir, step, recoveries=seen + 1)
                pid = actor_pid(name, namespace)
                rows = read_metrics(run_dir)
                logged_before.append(max(r["step"] for r in rows))
                seen = max(recovered(r) for r in rows)
                os.kill(pid, signal.SIGKILL)
                killed.append(name)
        except Exception as err:  # noqa: BLE001  (reported by the test)
            errors.append(err)

    killer = threading.Thread(target=kill_in_turn, daemon=True)
    killer.start()
    summary = run_experiment(cfg)
    killer.join(timeout=5)
    assert not errors, errors
    assert killed == [name for _, name, _ in kills], killed
    assert summary["status"] == "finished"
    return summary, logged_before


def every_step_trained_once(run_dir: Path, total: int) -> dict:
    """Check steps 0..total are logged once, in order, each training its own samples once (none lost,
    none trained twice, generated = trained + regenerated); returns the last step's metrics."""
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(total + 1))
    steps = rows[1:]
    assert [r["samples/trained"] for r in steps] == [s * STEP_SAMPLES for s in range(1, total + 1)]
    last = steps[-1]
    assert last["samples/generated"] == last["samples/trained"] + last["samples/regenerated"]
    return last


def test_async_run_survives_a_sigkill_of_every_role(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """PPO (a Critic) with a Reference and ActorFwd: every role of an async run in one run."""
    caplog.set_level(logging.WARNING, logger="relax")
    run_dir = tmp_path / "run"
    cfg = compose(
        [
            *TINY_RUN,
            "mode=async",
            "mode.max_staleness=1",
            "algorithm=ppo",  # a Critic
            "algorithm.kl_loss_coef=0.01",  # a Reference
            "trainer.global_batch_size=8",  # two optimizer steps per rollout batch: ActorFwd
            f"trainer.total_steps={TOTAL}",
            "trainer.save_every=3",
            "trainer.heartbeat_interval_s=1",
            "cluster.max_global_restarts=8",  # room for the half-trained steps below
        ],
        run_dir,
    )
    run_killing(cfg, run_dir, [(step, name, None) for step, name in KILLS])

    last = every_step_trained_once(run_dir, TOTAL)
    assert last["health/role_restarts"] >= 4  # rollout, Reference, ActorFwd, advantages
    # the Critic's and the Actor's deaths restart everything from a checkpoint; so does a kill that stops the
    # Actor between the two optimizer updates of a step (its rows cannot be trained again, nor can the step
    # be finished)
    restarts = [r.getMessage() for r in caplog.records if r.getMessage().startswith("health: global_restart")]
    assert sum("critic-0 died" in m for m in restarts) == 1, restarts
    assert sum("actor-0 died" in m for m in restarts) == 1, restarts
    assert all(
        "critic-0 died" in m or "actor-0 died" in m or "after an optimizer update" in m for m in restarts
    ), restarts
    assert last["health/global_restarts"] == len(restarts)
    assert (run_dir / "final_model" / "config.json").is_file()


def test_async_run_survives_sigkills_of_each_transferqueue_actor_and_its_teacher(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """TransferQueue's controller, then its storage unit: each time the roles' calls stop waiting on the dead
    actor, the driver starts a fresh TransferQueue and the steps in flight are regenerated. Then the frozen
    Teacher of on-policy distillation, replaced in place. (One run: a run's start costs more than its steps;
    the Critic's kill: test_async_run_survives_a_sigkill_of_every_role.)"""
    caplog.set_level(logging.WARNING, logger="relax")
    run_dir, total = tmp_path / "run", SHORT_RUN + 2
    overrides = [o for o in TINY_RUN if not o.startswith("cluster.num_cpus=")]
    overrides += ["cluster.num_cpus=8", "mode=async", "mode.max_staleness=1", "mode.databus=transferqueue"]
    overrides += ["algorithm=opd", "algorithm.teacher.train_steps=10"]
    overrides += [f"algorithm.teacher.cache_dir={tmp_path / 'teachers'}", "trainer.heartbeat_interval_s=1"]
    cfg = compose([*overrides, f"trainer.total_steps={total}"], run_dir)
    kills = [(2, CONTROLLER, CONTROLLER_NAMESPACE), (4, STORAGE_UNIT.format(0), None), (6, "teacher-0", None)]
    _, logged_before = run_killing(cfg, run_dir, kills)

    last = every_step_trained_once(run_dir, total)
    restarts = [r for r in caplog.records if "starting a fresh TransferQueue" in r.getMessage()]
    assert len(restarts) == 2, [r.getMessage() for r in caplog.records]
    # the last step logged before the Teacher's kill: each TransferQueue death retried the steps in flight
    # once, and no role was restarted
    before = next(r for r in read_metrics(run_dir) if r["step"] == logged_before[-1])
    assert before["health/step_retries"] == 2, before
    assert before["health/role_restarts"] == before["health/global_restarts"] == 0, before
    assert last["health/role_restarts"] >= 1, last  # the Teacher, replaced in place
    assert last["health/global_restarts"] == 0, last
