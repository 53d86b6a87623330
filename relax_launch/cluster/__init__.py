"""Where Ray comes from: an in-process local cluster or an existing cluster's address."""

from __future__ import annotations

import logging
import os

import ray

from relax_core.errors import RelaxUserError

log = logging.getLogger("relax")


def connect_ray(cluster_cfg, runtime_env: dict | None = None) -> None:
    """``cluster=local`` starts Ray in this process; ``cluster=ray`` attaches to ``cluster.address``."""
    if ray.is_initialized():
        return
    kwargs = {"include_dashboard": False, "log_to_driver": True, "runtime_env": runtime_env or {}}
    if cluster_cfg.name == "local":
        # "local" always starts a fresh Ray here, even when another cluster runs on the machine
        ray.init(
            address="local",
            num_cpus=cluster_cfg.num_cpus or os.cpu_count(),
            num_gpus=cluster_cfg.num_gpus,
            **kwargs,
        )
    elif cluster_cfg.name in ("ray", "slurm_allocation"):
        address = cluster_cfg.address or os.environ.get("RAY_ADDRESS") or "auto"
        try:
            ray.init(address=address, **kwargs)
        except (ConnectionError, RuntimeError) as err:
            raise RelaxUserError(
                f"cannot reach the Ray cluster at cluster.address={address!r}: {err}"
            ) from None
    else:
        raise RelaxUserError(f"cluster={cluster_cfg.name!r} cannot be connected from here")
    log.info(
        "Ray up: %s", {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU", "memory")}
    )
