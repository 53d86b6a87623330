"""Hydra callback for multiruns: one MLflow parent run per sweep, one child run per sweep point.

``on_multirun_start`` runs in the process that launches the sweep (before any point starts, whatever the
launcher: in-process basic, or a Slurm job array through hydra-submitit-launcher). It creates the parent run
in a tracking store shared by every point and exports ``RELAX_PARENT_RUN_ID`` and
``RELAX_SWEEP_TRACKING_URI``; points inherit them (in-process, or through sbatch's default
``--export=ALL``), and :class:`relax_core.metrics.MetricsSink` nests its run under the parent.

The shared store defaults to ``<sweep dir>/mlflow.db`` (SQLite). Points running at the same time on a cluster
write to it concurrently; SQLite serialises writers with a file lock, so the URI carries ``?timeout=120``
(wait for the lock instead of failing with "database is locked"). The sweep dir must be on a filesystem
with working POSIX locks (NFS often has none): there, or for many concurrent points, set
``logger.tracking_uri`` to an MLflow server (``mlflow server --backend-store-uri sqlite:///...``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from relax_core.errors import RelaxUserError
from relax_core.metrics import check_tracking_server, create_run, mlflow_client

log = logging.getLogger("relax")

SQLITE_LOCK_TIMEOUT_S = 120


def sweep_tracking_uri(sweep_dir: str | os.PathLike) -> str:
    path = Path(sweep_dir).resolve() / "mlflow.db"
    return f"sqlite:///{path}?timeout={SQLITE_LOCK_TIMEOUT_S}"


class SweepCallback(Callback):
    """Parent MLflow run around a multirun (no-op for single runs and for ``logger=jsonl``)."""

    def __init__(self) -> None:
        self.run_id: str | None = None
        self.uri: str | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.logger.name != "mlflow":
            return
        sweep_dir = Path(config.hydra.sweep.dir)
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
        if self.run_id is None:
            return
        mlflow_client(self.uri).set_terminated(self.run_id, "FINISHED")
        for key in ("RELAX_PARENT_RUN_ID", "RELAX_SWEEP_TRACKING_URI"):
            os.environ.pop(key, None)
