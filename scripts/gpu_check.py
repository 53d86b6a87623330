"""The GPU check's run (scripts/gpu_check.sh starts it): a short bf16 GRPO run in this one process, then one
JSON line with s/step, tokens/s and ``torch.cuda.max_memory_allocated``.

The run is ``python -m relax_launch cluster=in_process`` with the torch engine and the torch trainer as one
FSDP2 rank: a world of one still goes through NCCL on a GPU. The model is conf/model/qwen3_0p5b_random.yaml
(0.5B parameters, built in-process, no downloads). Relax runs from this checkout, not installed; Hydra and
OmegaConf come from the wheels gpu_check.sh unpacks (the GPU machine has torch and transformers only).

Environment: GPU_CHECK_DEVICE=cuda (default) or cpu (the same path on the CPU with a smaller model, gloo
instead of NCCL: the import closure and the run, checked where there is no GPU); GPU_CHECK_STEPS (default 8;
the first step is reported apart, it pays for CUDA's and the allocator's warm-up); GPU_CHECK_RUN_DIR; OUT
(a folder: the JSON line, metrics.jsonl and the run's log are copied there). Arguments are Hydra overrides
added last, e.g. ``rollout.batch_size=32``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")
if DEVICE == "cpu":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch loads: every role then picks the CPU

import torch  # noqa: E402  (after CUDA_VISIBLE_DEVICES)

# one process, one FSDP2 rank; no warm-start and no periodic eval (the eval before training stays)
COMMON = [
    "cluster=in_process",
    "logger=jsonl",
    "logger.plot=false",  # no matplotlib on the GPU machine
    "model=qwen3_0p5b_random",
    "trainer.fsdp=true",
    "trainer.dp_size=1",
    "trainer.sft_warmup_steps=0",
    "trainer.eval_every=0",
    "trainer.export_final_model=false",
    # the sort task's prompts are at most 11 tokens: the doctor sizes every row at this limit, and the
    # default (1024) would size activations no 8-step check needs (the launcher refuses what cannot fit)
    "data.max_prompt_len=16",
]
ON_DEVICE = {
    # 16 prompts x 8 samples x up to 64 new tokens a step (a random-init model rarely stops early); the
    # Actor and the engine share the one GPU (nothing reserves it in one process: this marks a GPU run)
    "cuda": ["rollout.max_new_tokens=64", "trainer.num_gpus=0.5", "rollout.num_gpus=0.5"],
    # a 2-layer model of the same family: the CPU trial proves the path, not the speed
    "cpu": [
        "rollout.max_new_tokens=8",
        "rollout.batch_size=4",
        "model.tiny.hidden_size=128",
        "model.tiny.intermediate_size=384",
        "model.tiny.num_hidden_layers=2",
        "model.tiny.num_attention_heads=4",
        "model.tiny.num_key_value_heads=2",
        "model.tiny.head_dim=32",
    ],
}


def use_checkout_config() -> None:
    """Make conf/ importable as ``relax_launch.conf`` (Hydra's pkg:// search path), as ``pip install``
    would map it (setup.py), so that the checkout runs without being installed."""
    sys.path.insert(0, str(ROOT))
    if importlib.util.find_spec("relax_launch.conf") is not None:  # an installed Relax maps it already
        return
    spec = importlib.util.spec_from_file_location(
        "relax_launch.conf", ROOT / "conf" / "__init__.py", submodule_search_locations=[str(ROOT / "conf")]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["relax_launch.conf"] = module
    spec.loader.exec_module(module)


def run(overrides: list[str]) -> int:
    """Run the experiment in this process; Hydra's exit status (0: finished)."""
    from relax_launch.cli import main

    sys.argv = ["relax_launch", *overrides]
    try:
        main()
    except SystemExit as err:
        return err.code if isinstance(err.code, int) else 1
    return 0


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def doctor(overrides: list[str]) -> dict[str, Any]:
    """The memory doctor's figures for the same overrides: GPU 0's total and each role's, in GB."""
    from omegaconf import OmegaConf

    from relax_core.preflight.memory import estimate
    from relax_launch.cli import compose_config

    report = estimate(OmegaConf.to_object(compose_config(overrides)))
    gpu = report.devices[0]
    return {
        "doctor_gb": round(gpu.total / 1e9, 2),
        "doctor_roles_gb": {r.role: round(r.total / 1e9, 2) for r in gpu.roles},
        "doctor_fits": report.fits,
    }


def report(run_dir: Path, status: int, wall_s: float) -> dict[str, Any]:
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    steps = [r for r in rows if "step_time_s" in r]
    steady = steps[1:] or steps  # the first step pays for kernel selection and the allocator's warm-up
    dist = torch.distributed
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "torch": torch.__version__,
        "dist_backend": dist.get_backend() if dist.is_available() and dist.is_initialized() else None,
        "exit_status": status,
        "steps": len(steps),
        "s_per_step": mean([r["step_time_s"] for r in steady]),
        "first_step_s": steps[0]["step_time_s"] if steps else None,
        "tokens_per_s": mean([r["tokens_per_s"] for r in steady]),
        "response_length": mean([r["response_length"] for r in steady]),
        **{
            k: mean([r[k] for r in steady if k in r])
            for k in ("time/rollout_s", "time/train_s", "time/weight_sync_s")
        },
        "max_memory_allocated": torch.cuda.max_memory_allocated() if DEVICE == "cuda" else None,
        "losses_finite": all(math.isfinite(r["loss"]) for r in steps if "loss" in r),
        "wall_s": round(wall_s, 1),
        "run_dir": str(run_dir),
    }
    result["ok"] = (
        status == 0
        and result["steps"] > 0
        and result["losses_finite"]
        and (DEVICE != "cuda" or result["dist_backend"] == "nccl")
    )
    return result


def keep_outputs(run_dir: Path, result: dict[str, Any]) -> None:
    """The JSON line and the run's small files into $OUT (what the device tool brings back)."""
    out = os.environ.get("OUT")
    if not out:
        return
    Path(out, "gpu_check.json").write_text(json.dumps(result, indent=1) + "\n")
    for name in ("metrics.jsonl", "summary.json", "config.yaml", "cli.log", "failure_report.json"):
        if (run_dir / name).exists():
            shutil.copy(run_dir / name, Path(out, name))


def main() -> int:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA device (GPU_CHECK_DEVICE=cpu runs on the CPU)"}))
        return 1
    steps = int(os.environ.get("GPU_CHECK_STEPS", "8" if DEVICE == "cuda" else "2"))
    run_dir = Path(os.environ.get("GPU_CHECK_RUN_DIR") or f"/tmp/relax_gpu_check/{time.strftime('%H%M%S')}")
    use_checkout_config()
    overrides = [
        *COMMON,
        *ON_DEVICE[DEVICE],
        f"trainer.total_steps={steps}",
        f"hydra.run.dir={run_dir}",
        *sys.argv[1:],
    ]
    predicted = doctor([o for o in overrides if not o.startswith("hydra.")])
    start = time.perf_counter()
    status = run(overrides)
    result = report(run_dir, status, time.perf_counter() - start) | predicted
    keep_outputs(run_dir, result)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
