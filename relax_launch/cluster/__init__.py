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
        for attempt in range(3):
            try:
                ray.init(
                    address="local",
                    num_cpus=cluster_cfg.num_cpus or os.cpu_count(),
                    num_gpus=cluster_cfg.num_gpus,
                    **kwargs,
                )
                break
            except (
                Exception
            ) as err:  # Ray gives its raylet a fixed 30 s to register: overloaded hosts miss it
                if "timed out during startup" not in str(err) or attempt == 2:
                    raise
                log.warning("Ray did not start in time (attempt %d, host overloaded?); retrying", attempt + 1)
                ray.shutdown()
    elif cluster_cfg.name in ("ray", "slurm_allocation", "slurm"):  # slurm: the job's own cluster
        address = cluster_cfg.address or os.environ.get("RAY_ADDRESS") or "auto"
        _check_reachable(address)
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


def _check_reachable(address: str, wait_s: float = 15.0) -> None:
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
