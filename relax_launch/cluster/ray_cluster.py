"""``cluster=ray``: attach to a Ray cluster started outside Relax (``ray start --head``)."""

from __future__ import annotations

from typing import Any

from relax_core.config.schema import RayClusterConfig
from relax_launch.cluster.base import InProcessLauncher, attach_ray


class RayLauncher(InProcessLauncher):
    schema = RayClusterConfig
    cluster: RayClusterConfig

    def connect(self, runtime_env: dict[str, Any]) -> None:
        attach_ray(self.cluster.address, runtime_env)
