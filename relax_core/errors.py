"""Errors a user can cause (bad config, missing files, malformed data).

``RelaxUserError`` lives in the model layer (``relax_models.errors``), the lowest package that raises it;
this is its name for the engine and the launcher, which catch it around a run. ``RunFailedError`` (a run
that must stop) lives here too, below both the health manager and the checkpoint code that raise it.
"""

from __future__ import annotations

import errno
import os

from relax_models.errors import RelaxUserError

__all__ = ["ClusterTooSmall", "RelaxUserError", "RunFailedError", "disk_full", "nonfinite_weights_error"]


def disk_full(err: BaseException, path: str | os.PathLike) -> RelaxUserError | None:
    """A one-line error naming ``path`` when ``err`` (or what it wraps) is a full disk, else None.

    torch's writer and Ray report ENOSPC as text in their own exception types, so the message counts too.
    """
    while err is not None:
        if (isinstance(err, OSError) and err.errno == errno.ENOSPC) or "No space left on device" in str(err):
            return RelaxUserError(
                f"no space left on the device holding {os.fspath(path)}: free space there "
                "or point the run elsewhere (hydra.run.dir=...)"
            )
        err = err.__cause__ or err.__context__
    return None


class ClusterTooSmall(RelaxUserError):
    """Ray has less than the roles need (at launch: raise the cluster; after a lost node: wait for one)."""


class RunFailedError(RuntimeError):
    """The run cannot continue: recoveries are exhausted, or it must not go on (the first line of the
    message says why; ``relax_launch`` prints it alone)."""


def nonfinite_weights_error(path: str, count: int, example: str | None) -> RunFailedError:
    """Why ``path`` is not written: ``count`` policy weight tensors hold NaN or inf (``example``: one)."""
    shown = f" (e.g. {example!r})" if example else ""
    return RunFailedError(
        f"not writing {path}: {count} policy weight tensor(s) hold NaN or inf{shown}; the run's training diverged"
    )
