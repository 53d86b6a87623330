"""Kill -9 a run mid-way, re-run the same command with ``trainer.resume=auto``: it continues from the last
checkpoint and, with deterministic CPU settings, its per-step rewards equal those of an uninterrupted run.

The killed run is ``mode=async`` at ``mode.max_staleness=0``, the uninterrupted one colocate: one comparison
shows both that a resumed run repeats the steps it would have taken and that staleness 0 is colocate
(colocate's own resume is tested in-process, ``tests/e2e/test_in_process.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from resilience_helpers import TINY_RUN, TINY_RUN_IN_PROCESS, read_metrics

pytestmark = pytest.mark.slow

TOTAL = 8  # steps of ~0.05 s: after step 3 is seen, enough of them left that the kill lands mid-run


def _command(run_dir: Path, mode: list[str], tiny_run: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "relax_launch",
        *tiny_run,
        *mode,
        f"trainer.total_steps={TOTAL}",
        "trainer.save_every=2",
        "trainer.resume=auto",
        f"hydra.run.dir={run_dir}",
    ]


def _rewards(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["reward/mean"] for r in read_metrics(run_dir) if "reward/mean" in r}


# async at staleness 0 follows colocate's schedule (a step is one engine call, the Actor takes its micro-batches
# with colocate's weights), so its resumed curve must equal colocate's, float rounding included (the
# checkpoint holds the data position and engine RNG of the first step not handed out)
ASYNC_AT_ZERO = ["mode=async", "mode.max_staleness=0"]


def _kill_and_resume(resumed: Path, env: dict, cwd: Path) -> None:
    """Start the async run, SIGKILL it with everything it started once step 3 and a checkpoint are logged,
    then re-run the same command: it resumes from the checkpoint and finishes."""
    proc = subprocess.Popen(
        _command(resumed, ASYNC_AT_ZERO, TINY_RUN),
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 600
    while not (3 in _rewards(resumed) and (resumed / "checkpoints" / "step_000002" / "meta.json").is_file()):
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "step 3 not reached"
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and everything it started (Ray, role actors)
    proc.wait()
    assert not (resumed / "summary.json").exists()
    steps_before = max(_rewards(resumed))
    assert steps_before < TOTAL

    again = subprocess.run(
        _command(resumed, ASYNC_AT_ZERO, TINY_RUN),
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert (
        "resumed from" in again.stderr + again.stdout or "resumed from" in (resumed / "cli.log").read_text()
    )


def test_async_killed_and_rerun_takes_the_uninterrupted_colocate_runs_steps(tmp_path: Path) -> None:
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    # the uninterrupted colocate run goes without Ray (it takes a Ray run's steps exactly), alongside the
    # killed one: nothing of it is timed, and it overlaps the other's Ray start instead of adding to it
    straight_log = tmp_path / "straight.log"
    with straight_log.open("w") as log:
        first = subprocess.Popen(
            _command(straight, [], TINY_RUN_IN_PROCESS),
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        _kill_and_resume(resumed, env, tmp_path)
        first.wait(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, straight_log.read_text()[-3000:]
    # every step once: those after the checkpoint that the killed attempt had logged were dropped and re-run
    assert [r["step"] for r in read_metrics(resumed)] == list(range(0, TOTAL + 1))
    assert len(_rewards(straight)) == TOTAL
    steps, colocate = read_metrics(resumed)[1:], read_metrics(straight)[1:]
    for ra, rb in zip(colocate, steps, strict=True):
        assert rb["staleness/max"] == 0
        assert rb["reward/mean"] == ra["reward/mean"] and rb["reward/std"] == ra["reward/std"], ra["step"]
        assert (rb["loss"], rb["grad_norm"]) == (ra["loss"], ra["grad_norm"]), ra["step"]
