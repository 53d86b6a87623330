"""compose (Hydra) -> validate -> resolve -> start Ray -> run the loop (relax_core/run_loop.py) -> report."""

from __future__ import annotations

import json
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


def run_experiment(cfg: DictConfig, in_allocation: bool = False) -> dict[str, Any]:
    """Run one experiment to completion and return its summary (also written to summary.json).

    ``cluster=slurm`` outside a Slurm job submits the run as a job instead (relax_launch/cluster/slurm.py);
    inside one (``in_allocation``, or a sweep point already running in an allocation) Ray is built across
    the allocation first.
    """
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    if os.environ.get("SLURM_RESTART_COUNT", "0") != "0" and not cfg.trainer.resume:
        cfg.trainer.resume = "auto"  # a requeued Slurm job (or sweep point) continues from its checkpoint
    config = OmegaConf.to_object(cfg)  # typed RelaxConfig with every interpolation resolved
    validate(config)
    if config.cluster.name == "slurm" and not in_allocation:
        from relax_launch.cluster.slurm import inside_slurm_job, run_in_allocation, submit_run

        summary = run_in_allocation(cfg) if inside_slurm_job() else submit_run(cfg)
        if summary and summary.get("status") == "finished":
            report(summary)
        return summary
    sweep_uri = os.environ.get("RELAX_SWEEP_TRACKING_URI")  # set by relax_launch.sweep for a multirun
    if sweep_uri and config.logger.tracking_uri is None:
        config.logger.tracking_uri = cfg.logger.tracking_uri = sweep_uri
    resolved = OmegaConf.to_container(cfg, resolve=True)
    from relax_core.health import RunFailedError
    from relax_core.notify import Notifier
    from relax_core.run_loop import RunLoop

    notifier = Notifier(
        config.logger.notify_urls, config.logger.run_name or os.path.basename(config.output_dir)
    )
    loop = RunLoop(config, resolved)  # loads model folder and data: user errors surface here
    connect_ray(config.cluster, runtime_env={"env_vars": QUIET_ENV})
    notifier.send("start", f"run started: {config.output_dir} ({config.trainer.total_steps} steps)")
    try:
        summary = loop.run()
    except BaseException as err:
        text = str(err) if isinstance(err, RunFailedError) else f"{type(err).__name__}: {err}"
        log.error("%s", text)
        notifier.send("failure", f"run failed: {config.output_dir}\n{text}")
        raise
    finally:
        ray.shutdown()
    if summary.get("status") == "preempted":
        notifier.send("preempted", f"run preempted at step {summary['steps']}: checkpoint saved, requeueing")
        return summary
    notifier.send("finish", f"run finished: {config.output_dir}\n{json.dumps(summary, default=str)}")
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
