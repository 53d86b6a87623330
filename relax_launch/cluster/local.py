"""``cluster=local``: a fresh Ray started inside this process on this machine."""

from __future__ import annotations

import logging
import os
from typing import Any

from relax_core.config.schema import LocalClusterConfig
from relax_launch.cluster.base import RAY_INIT_ARGS, InProcessLauncher, log_resources

log = logging.getLogger("relax")


class LocalLauncher(InProcessLauncher):
    schema = LocalClusterConfig
    cluster: LocalClusterConfig

    def connect(self, runtime_env: dict[str, Any]) -> None:
        import ray  # here only: cluster=in_process runs where Ray is not installed

        if ray.is_initialized():
            return
        # "local" always starts a fresh Ray here, even when another cluster runs on the machine
        for attempt in range(3):
            try:
                ray.init(
                    address="local",
                    num_cpus=self.cluster.num_cpus or os.cpu_count(),
                    num_gpus=self.cluster.num_gpus,
                    runtime_env=runtime_env,
                    # no idle workers started ahead of actors that never use them (~80 MB each)
                    _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False},
                    **RAY_INIT_ARGS,
                )
                break
            # Ray gives its raylet a fixed 30 s to register: overloaded hosts miss it
            except Exception as err:
                if "timed out during startup" not in str(err) or attempt == 2:
                    raise
                log.warning("Ray did not start in time (attempt %d, host overloaded?); retrying", attempt + 1)
                ray.shutdown()
        log_resources()
