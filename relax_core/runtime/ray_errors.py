"""Ray's error classes, or stand-ins where Ray is not installed.

``cluster=in_process`` runs on a machine without Ray (a bare torch box, scripts/gpu_check.sh). Nothing there
raises Ray's errors, so the stand-ins only keep the ``except`` clauses of health and the data bus valid.
"""

from __future__ import annotations

import sys

try:
    from ray.exceptions import GetTimeoutError, RayActorError, WorkerCrashedError
except ImportError:
    # a folder named ray on sys.path (Ray's /tmp/ray seen from the working directory) imports as an empty
    # namespace package: drop it, or the checks of sys.modules["ray"] would take it for a running Ray
    sys.modules.pop("ray", None)

    class RayActorError(Exception):  # type: ignore[no-redef]
        """Stand-in: no Ray actor exists in this process."""

    class WorkerCrashedError(Exception):  # type: ignore[no-redef]
        """Stand-in: no Ray worker exists in this process."""

    class GetTimeoutError(TimeoutError):  # type: ignore[no-redef]
        """Stand-in: no Ray reference is awaited in this process."""


__all__ = ["GetTimeoutError", "RayActorError", "WorkerCrashedError"]
