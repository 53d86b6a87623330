"""How the tests run ``python -m relax_launch`` as a user does: one subprocess per run, with the environment
every launch gets, and the run folder's outputs read back.

A test that launches is heavy (tests/tiers.py): it gets the ``relax_launch_cmd`` fixture or a ``slow``
marker, and the quick tier fails it if it launches without one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RELAX_LAUNCH = [sys.executable, "-m", "relax_launch"]
# for runs whose Ray must not depend on what earlier tests left in ~/.ray (Ray turns token auth on when
# ~/.ray/auth_token exists): no token auth, no usage report
RAY_NO_AUTH = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def launch_env(extra: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """The test session's environment for a run: offline and quiet (tests/conftest.py), without a Ray address
    or Hydra's full tracebacks from the caller's shell, and the repository on the path (examples/ and agent
    programs import from it); ``extra`` on top (a None value removes the variable)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RAY_ADDRESS")}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
    )
    env |= dict(extra or {})
    return {k: v for k, v in env.items() if v is not None}


def launch(
    run_dir: Path | None,
    *overrides: str,
    env: Mapping[str, str | None] | None = None,
    cwd: Path | None = None,
    timeout: float = 1500,
    check: bool = True,
    command: Sequence[str] = RELAX_LAUNCH,
) -> subprocess.CompletedProcess:
    """``python -m relax_launch <overrides> hydra.run.dir=<run_dir>`` (no run folder override when
    ``run_dir`` is None), run to its end in ``cwd`` (default: the run folder's parent); ``check``: the run
    must exit 0, else the test fails showing the end of its output. ``env``: extra variables
    (:func:`launch_env`); ``command``: another entry point to the same launcher."""
    args = [*command, *overrides, *([f"hydra.run.dir={run_dir}"] if run_dir is not None else [])]
    if cwd is None and run_dir is not None:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        args,
        cwd=cwd or (run_dir.parent if run_dir is not None else None),
        env=launch_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check:
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result


def start(
    run_dir: Path, *overrides: str, env: Mapping[str, str | None] | None = None, cwd: Path | None = None
) -> subprocess.Popen:
    """The same run in the background (stdout and stderr as one text stream), for a test that signals or
    kills it while it runs."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [*RELAX_LAUNCH, *overrides, f"hydra.run.dir={run_dir}"],
        cwd=cwd or run_dir.parent,
        env=launch_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def read_summary(run_dir: Path) -> dict:
    """The run's ``summary.json``."""
    return json.loads((run_dir / "summary.json").read_text())


def read_metrics(run_dir: Path) -> list[dict]:
    """Every row of the run's ``metrics.jsonl``, in order."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line]
