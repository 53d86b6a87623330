"""The interface every ``cluster=...`` option implements: where a run's Ray cluster comes from.

A launcher is given the experiment to run (:func:`relax_launch.experiment.run_experiment_on_ray`) and never
calls back into the dispatch of :mod:`relax_launch.run`. It either runs the experiment in this process,
handing it :meth:`ClusterLauncher.connect` to call once the run is ready for Ray (model and data are loaded
first, so user errors surface before Ray starts), or runs it somewhere else (a Slurm job) and returns the
summary that comes back.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from omegaconf import DictConfig

from relax_core.config.schema import ClusterConfig
from relax_core.errors import RelaxUserError
from relax_launch.experiment import Experiment, Summary

log = logging.getLogger("relax")

RAY_INIT_ARGS = {"include_dashboard": False, "log_to_driver": True}


class ClusterLauncher(ABC):
    """Runs an experiment on one kind of Ray cluster; ``schema`` is the option's config dataclass."""

    schema: ClassVar[type[ClusterConfig]]

    def __init__(self, cluster: ClusterConfig) -> None:
        self.cluster = cluster

    @abstractmethod
    def launch(self, cfg: DictConfig, experiment: Experiment) -> Summary | None:
        """Run ``experiment`` (here, or in a job it submits) and return its summary."""


class InProcessLauncher(ClusterLauncher):
    """Runs the experiment in this process; the experiment calls :meth:`connect` when it is ready for Ray."""

    def launch(self, cfg: DictConfig, experiment: Experiment) -> Summary | None:
        return experiment(cfg, self.connect)

    @abstractmethod
    def connect(self, runtime_env: dict[str, Any]) -> None:
        """Start or attach to this option's Ray cluster from this process."""


def attach_ray(address: str, runtime_env: dict[str, Any], wait_s: float = 15.0) -> None:
    """Connect this process to the running Ray cluster at ``address`` (``host:port`` or ``"auto"``)."""
    import ray  # the Ray options import it; cluster=in_process runs where it is not installed

    if ray.is_initialized():
        return
    check_reachable(address, wait_s)
    try:
        ray.init(address=address, runtime_env=runtime_env, **RAY_INIT_ARGS)
    except (ConnectionError, RuntimeError) as err:
        raise RelaxUserError(f"cannot reach the Ray cluster at cluster.address={address!r}: {err}") from None
    log_resources()


def log_resources() -> None:
    import ray

    log.info(
        "Ray up: %s", {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU", "memory")}
    )


def check_reachable(address: str, wait_s: float) -> None:
    """Fail fast on ``host:port`` with nothing listening: ``ray.init`` would retry for many minutes."""
    import socket
    import time

    if address == "auto" or "://" in address or ":" not in address:
        return
    host, port = address.rsplit(":", 1)
    if not port.isdigit():
        raise RelaxUserError(f"cluster.address={address!r} is not host:port")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                return
        except OSError as err:
            if time.monotonic() > deadline:
                raise RelaxUserError(
                    f"cannot reach the Ray cluster at cluster.address={address!r}: {err}"
                ) from None
            time.sleep(0.5)
