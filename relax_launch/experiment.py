"""One experiment on a Ray cluster: load model and data, connect Ray, run the loop (relax_core/run_loop.py).

This is the run function every launcher (relax_launch/cluster/) is given; it never chooses a cluster.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("relax")

Summary = dict[str, Any]
# connect(runtime_env): the launcher's Ray is initialised in this process afterwards
Connect = Callable[[dict[str, Any]], None]
# what a launcher is given to run: experiment(cfg, connect) -> summary (None on the worker tasks of a
# multi-node Slurm job)
Experiment = Callable[[DictConfig, Connect], Summary | None]

# quiet third-party chatter in every process of the run
QUIET_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_DEDUP_LOGS": "1",
    "TQ_LOGGING_LEVEL": "ERROR",  # TransferQueue (mode.databus=transferqueue) warns on every call
}


# what a finished run leaves in its run dir, as the last log line lists it (the loggers pick some)
OUTPUTS = (
    "metrics.jsonl",
    "reward_curve.png",
    "mlflow.db",
    "tensorboard",
    "wandb",
    "final_model",
    "config.yaml",
)


def quiet_third_parties() -> None:
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)


def run_experiment_on_ray(cfg: DictConfig, connect: Connect) -> Summary:
    """Run the (validated) experiment ``cfg`` to completion; ``connect`` brings up the launcher's Ray once
    model and data are loaded. Returns the summary (also written to summary.json)."""
    quiet_third_parties()
    if os.environ.get("SLURM_RESTART_COUNT", "0") != "0" and not cfg.trainer.resume:
        cfg.trainer.resume = "auto"  # a requeued Slurm job (or sweep point) continues from its checkpoint
    config = OmegaConf.to_object(cfg)  # typed RelaxConfig with every interpolation resolved
    sweep_uri = os.environ.get("RELAX_SWEEP_TRACKING_URI")  # set by relax_launch.sweep for a multirun
    if sweep_uri and config.logger.tracking_uri is None:
        config.logger.tracking_uri = cfg.logger.tracking_uri = sweep_uri
    resolved = OmegaConf.to_container(cfg, resolve=True)
    from relax_core.errors import RelaxUserError
    from relax_core.resilience.health import RunFailedError
    from relax_core.run_loop import RunLoop
    from relax_core.telemetry.notify import Notifier

    notifier = Notifier(
        config.logger.notify_urls, config.logger.run_name or os.path.basename(config.output_dir)
    )
    loop = RunLoop(config, resolved)  # loads model folder and data: user errors surface here
    connect({"env_vars": QUIET_ENV})
    notifier.send("start", f"run started: {config.output_dir} ({config.trainer.total_steps} steps)")
    try:
        summary = loop.run()
    except BaseException as err:
        text = (
            str(err) if isinstance(err, RunFailedError | RelaxUserError) else f"{type(err).__name__}: {err}"
        )
        if not isinstance(err, RelaxUserError):  # the CLI reports those itself, once
            log.error("%s", text)
        notifier.send("failure", f"run failed: {config.output_dir}\n{text}")
        raise
    finally:
        ray = sys.modules.get("ray")  # not imported by cluster=in_process, which runs without Ray installed
        if ray is not None:
            ray.shutdown()
    if summary.get("status") == "preempted":
        notifier.send("preempted", f"run preempted at step {summary['steps']}: checkpoint saved, requeueing")
        return summary
    notifier.send("finish", f"run finished: {config.output_dir}\n{json.dumps(summary, default=str)}")
    return summary


def report(summary: Summary | None) -> None:
    """Log the outcome of a finished run (nothing for a preempted run or a job not waited for)."""
    if not summary or summary.get("status") != "finished":
        return

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
    out = summary["output_dir"]
    written = [name for name in OUTPUTS if os.path.exists(os.path.join(out, name))]
    log.info("outputs: %s (%s)", out, ", ".join(written))
