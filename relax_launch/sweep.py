"""Sweeps: one MLflow parent run and one W&B group per sweep; the value a point returns to a sweeper.

``on_multirun_start`` runs in the process that launches the sweep (before any point starts, whatever the
launcher: in-process basic, or a Slurm job array through hydra-submitit-launcher). It creates the parent run
in a tracking store shared by every point and exports ``RELAX_PARENT_RUN_ID`` and
``RELAX_SWEEP_TRACKING_URI``; points inherit them (in-process, or through sbatch's default
``--export=ALL``), and :class:`relax_core.telemetry.metrics.MetricsSink` nests its run under the parent.

The shared store defaults to ``<sweep dir>/mlflow.db`` (SQLite). Points running at the same time on a cluster
write to it concurrently; SQLite serialises writers with a file lock, so the URI carries ``?timeout=120``
(wait for the lock instead of failing with "database is locked"). The sweep dir must be on a filesystem
with working POSIX locks (NFS often has none): there, or for many concurrent points, set
``logger.tracking_uri`` to an MLflow server (``mlflow server --backend-store-uri sqlite:///...``).

W&B needs no shared store: every point's run carries the group ``RELAX_SWEEP_GROUP`` names.

A sweeper that optimises (``hydra/sweeper=optuna``) reads what each point returns: :func:`sweep_objective`
of its summary, or None for a failed point. The Optuna sweeper records None as a failed trial and goes on;
NaN would end the search (hydra-optuna-sweeper 1.3.0 then tells Optuna a failed trial with a value, which
Optuna refuses), and so would an exception (``max_failure_rate`` 0).
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from relax_core.errors import RelaxUserError
from relax_core.telemetry.metrics import check_tracking_server, create_run, mlflow_client

log = logging.getLogger("relax")

SQLITE_LOCK_TIMEOUT_S = 120
_MISSING = object()


def sweep_tracking_uri(sweep_dir: str | os.PathLike) -> str:
    path = Path(sweep_dir).resolve() / "mlflow.db"
    return f"sqlite:///{path}?timeout={SQLITE_LOCK_TIMEOUT_S}"


def optimising_sweep() -> bool:
    """True in a multirun whose sweeper reads the points' return values (Optuna and the other optimisers);
    Hydra's basic sweeper ignores them."""
    hydra_cfg = HydraConfig.get()
    target = str(hydra_cfg.sweeper.get("_target_", ""))
    return hydra_cfg.mode == RunMode.MULTIRUN and not target.endswith(".BasicSweeper")


def sweep_objective(summary: dict[str, Any] | None, metric: str) -> float | None:
    """``metric`` of a finished run: a ``summary.json`` key (``eval_sets_final.<set>.pass@4`` reaches
    into nested ones), else the last value of a per-step metric in ``metrics.jsonl``; None when the run did
    not finish (preempted, or a Slurm job not waited for) or left the metric empty or NaN (no eval set)."""
    if not summary or summary.get("status") != "finished":
        return None
    node: Any = summary
    for part in metric.split("."):
        node = node[part] if isinstance(node, dict) and part in node else _MISSING
    if node is _MISSING:
        path = Path(summary["output_dir"]) / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
        values = [row[metric] for row in rows if metric in row]
        if not values:
            raise RelaxUserError(
                f"sweep_metric={metric!r} is neither a summary.json key nor a metric in {path} "
                f"(summary keys: {', '.join(sorted(summary))})"
            )
        node = values[-1]
    if node is not None and not isinstance(node, int | float):
        raise RelaxUserError(f"sweep_metric={metric!r} is not a number but {type(node).__name__}: {node!r}")
    return None if node is None or math.isnan(node) else float(node)


def sweep_group(sweep_dir: Path) -> str:
    """The W&B group of a sweep's points: ``sweep-<date>-<time>`` for Hydra's default sweep dir."""
    return f"sweep-{sweep_dir.parent.name}-{sweep_dir.name}"


def let_failed_grid_points_end_the_grid() -> None:
    """A failed last point of an Optuna grid search must not end the sweep. Optuna's GridSampler calls
    ``Study.stop()`` once the grid is done, which raises outside ``Study.optimize``; hydra-optuna-sweeper 1.3.0
    ignores that error after a completed trial but not after a failed one, so the search died whenever the
    grid's last point (in random order) failed. The sweeper's loop ends after ``n_trials`` by itself, so the
    stop is not needed there: this sampler skips it."""
    from optuna.samplers import GridSampler

    after_trial = GridSampler.after_trial
    if getattr(after_trial, "relax_skips_stop", False):
        return

    def after_trial_without_stop(self, study, trial, state, values) -> None:  # noqa: ANN001 (optuna's)
        try:
            after_trial(self, study, trial, state, values)
        except RuntimeError as err:
            if "Study.stop" not in str(err):
                raise

    after_trial_without_stop.relax_skips_stop = True  # type: ignore[attr-defined]
    GridSampler.after_trial = after_trial_without_stop


class SweepCallback(Callback):
    """Parent MLflow run and W&B group around a multirun (no-op for single runs; no parent run for loggers
    other than MLflow)."""

    def __init__(self) -> None:
        self.run_id: str | None = None
        self.uri: str | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if "optuna" in str(config.hydra.sweeper.get("_target_", "")):
            let_failed_grid_points_end_the_grid()
        sweep_dir = Path(config.hydra.sweep.dir)
        os.environ["RELAX_SWEEP_GROUP"] = sweep_group(sweep_dir.resolve())
        if config.logger.name != "mlflow":
            return
        sweep_dir.mkdir(parents=True, exist_ok=True)
        try:
            check_tracking_server(config.logger.tracking_uri)
        except RelaxUserError:
            return  # no parent run: the first point's launch stops on this, with one error line
        self.uri = config.logger.tracking_uri or sweep_tracking_uri(sweep_dir)
        client = mlflow_client(self.uri)
        overrides = list(config.hydra.overrides.task)
        tags = {"relax.sweep_dir": str(sweep_dir.resolve()), "relax.sweep": " ".join(overrides)}
        self.run_id = create_run(client, config.logger.experiment_name, f"sweep {sweep_dir.name}", tags)
        os.environ["RELAX_PARENT_RUN_ID"] = self.run_id
        os.environ["RELAX_SWEEP_TRACKING_URI"] = self.uri
        (sweep_dir / "mlflow_parent_run_id").write_text(self.run_id + "\n")
        log.info("sweep: MLflow parent run %s at %s", self.run_id, self.uri)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        os.environ.pop("RELAX_SWEEP_GROUP", None)
        if self.run_id is None:
            return
        mlflow_client(self.uri).set_terminated(self.run_id, "FINISHED")
        for key in ("RELAX_PARENT_RUN_ID", "RELAX_SWEEP_TRACKING_URI"):
            os.environ.pop(key, None)
