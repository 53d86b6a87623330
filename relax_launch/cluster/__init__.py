"""Where a run's Ray cluster comes from: one launcher per ``cluster`` option (conf/cluster/*.yaml).

Each option has its own module, launcher class and config schema (relax_core/config/schema.py); the ``cluster``
config group validates an option's fields against its schema (relax_launch/cli.py registers them).
"""

from __future__ import annotations

from relax_core.config.schema import ClusterConfig
from relax_core.errors import RelaxUserError
from relax_launch.cluster.base import ClusterLauncher
from relax_launch.cluster.in_process import SingleProcessLauncher
from relax_launch.cluster.local import LocalLauncher
from relax_launch.cluster.ray_cluster import RayLauncher
from relax_launch.cluster.slurm_allocation import SlurmAllocationLauncher
from relax_launch.cluster.slurm_submit import SlurmSubmitLauncher

LAUNCHERS: dict[str, type[ClusterLauncher]] = {
    "local": LocalLauncher,
    "in_process": SingleProcessLauncher,
    "ray": RayLauncher,
    "slurm": SlurmSubmitLauncher,
    "slurm_allocation": SlurmAllocationLauncher,
}


def launcher_for(cluster: ClusterConfig) -> ClusterLauncher:
    launcher = LAUNCHERS.get(cluster.name)
    if launcher is None or not isinstance(cluster, launcher.schema):
        raise RelaxUserError(
            f"cluster.name={cluster.name!r} does not name this cluster option; pick one with cluster=<name> "
            f"({', '.join(LAUNCHERS)}) instead of setting cluster.name"
        )
    return launcher(cluster)
