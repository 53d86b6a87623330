"""``cluster=slurm_allocation``: run inside a Slurm job, on one Ray cluster over the job's nodes.

The cluster is the one the job script started (``examples/slurm/relax.sbatch`` sets ``RAY_ADDRESS``) or
``cluster.address``; without either (``salloc``, a sweep point of ``hydra/launcher=slurm``), it is built here
by :func:`run_over_allocation`. ``cluster=slurm`` runs its submitted job through that same function.
"""

from __future__ import annotations

import functools
import logging
import os
import time

from omegaconf import DictConfig

from relax_core.config.schema import SlurmAllocationConfig
from relax_core.errors import RelaxUserError
from relax_launch.cluster.base import ClusterLauncher, attach_ray
from relax_launch.cluster.slurm_bootstrap import bootstrap_ray_in_allocation, stop_ray
from relax_launch.experiment import Experiment, Summary

log = logging.getLogger("relax")


def inside_slurm_job() -> bool:
    return "SLURM_JOB_ID" in os.environ


def run_over_allocation(
    cfg: DictConfig, experiment: Experiment, ray_port: int | None = None
) -> Summary | None:
    """Ray across the allocation (head on node 0, the other nodes join), ``experiment`` on node 0, Ray down.

    Returns the summary on node 0 and None on the other nodes' tasks, which serve as Ray workers until the
    head stops.
    """
    if not inside_slurm_job():
        raise RelaxUserError(
            f"cluster={cfg.cluster.name}: not inside a Slurm job (no SLURM_JOB_ID); submit with cluster=slurm "
            "or attach to a running Ray cluster with cluster=ray"
        )
    started = time.monotonic()
    address = bootstrap_ray_in_allocation(port=ray_port)
    if address is None:  # a worker node: it served until the head stopped
        return None
    log.info("Ray cluster over the allocation ready in %.1fs at %s", time.monotonic() - started, address)
    try:
        return experiment(cfg, functools.partial(attach_ray, address))
    finally:
        stop_ray()


class SlurmAllocationLauncher(ClusterLauncher):
    schema = SlurmAllocationConfig
    cluster: SlurmAllocationConfig

    def launch(self, cfg: DictConfig, experiment: Experiment) -> Summary | None:
        if self.address() is None:
            return run_over_allocation(cfg, experiment)
        return experiment(cfg, self.connect)

    def address(self) -> str | None:
        return self.cluster.address or os.environ.get("RAY_ADDRESS")

    def connect(self, runtime_env: dict) -> None:
        attach_ray(self.address() or "auto", runtime_env)
