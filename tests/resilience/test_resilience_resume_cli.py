"""Kill -9 a run mid-way, re-run the same command with ``trainer.resume=auto``: it continues from the last
checkpoint and, with deterministic CPU settings, its per-step rewards equal those of an uninterrupted run."""

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


def _command(run_dir: Path, mode: list[str], tiny_run: list[str] = TINY_RUN) -> list[str]:
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


# async at staleness 0 follows colocate's schedule, so its resumed curve must equal the uninterrupted one
# (the checkpoint holds the data position and engine RNG of the first step not handed out)
@pytest.mark.parametrize("mode", [[], ["mode=async", "mode.max_staleness=0"]], ids=["colocate", "async"])
def test_kill_and_rerun_continues_from_the_checkpoint_like_an_uninterrupted_run(
    tmp_path: Path, mode: list[str]
) -> None:
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    # the resumed run goes first; its kill is timed on its own progress
    proc = subprocess.Popen(
        _command(resumed, mode),
        cwd=tmp_path,
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
        _command(resumed, mode), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert (
        "resumed from" in again.stderr + again.stdout or "resumed from" in (resumed / "cli.log").read_text()
    )

    # colocate's uninterrupted run goes without Ray; async's must be async (it follows its own schedule)
    straight_command = _command(straight, mode, TINY_RUN_IN_PROCESS if not mode else TINY_RUN)
    first = subprocess.run(
        straight_command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert first.returncode == 0, first.stderr[-3000:]

    # every step once: those after the checkpoint that the killed attempt had logged were dropped and re-run
    assert [r["step"] for r in read_metrics(resumed)] == list(range(0, TOTAL + 1))
    assert _rewards(resumed) == _rewards(straight)
    assert len(_rewards(straight)) == TOTAL
