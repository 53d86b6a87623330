"""compose (Hydra) -> validate -> resolve -> start Ray -> run the controller -> report."""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
from omegaconf import DictConfig, OmegaConf

from relax_core.validation import validate
from relax_launch.cluster import connect_ray

log = logging.getLogger("relax")

# quiet third-party chatter in every process of the run
QUIET_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_DEDUP_LOGS": "1",
}


def run_experiment(cfg: DictConfig) -> dict[str, Any]:
    """Run one experiment to completion and return its summary (also written to summary.json)."""
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    config = OmegaConf.to_object(cfg)  # typed RelaxConfig with every interpolation resolved
    validate(config)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    from relax_core.controller import Controller

    controller = Controller(config, resolved)  # loads model folder and data: user errors surface here
    connect_ray(config.cluster, runtime_env={"env_vars": QUIET_ENV})
    try:
        summary = controller.run()
    finally:
        ray.shutdown()
    report(summary)
    return summary


def report(summary: dict[str, Any]) -> None:
    def fmt(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    log.info(
        "done: %s steps | reward %s -> %s (first/last 10%%, gain %s) | eval accuracy %s untrained, %s start, %s final",
        summary["steps"],
        fmt(summary["reward_first_10pct"]),
        fmt(summary["reward_last_10pct"]),
        fmt(summary["reward_gain"]),
        fmt(summary["eval_accuracy_untrained"]),
        fmt(summary["eval_accuracy_start"]),
        fmt(summary["eval_accuracy_final"]),
    )
    log.info("outputs: %s (metrics.jsonl, reward_curve.png, mlflow.db, config.yaml)", summary["output_dir"])
