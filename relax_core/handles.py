"""Role handles that are called the same way whether the role is a Ray actor or an object in this process.

``cluster=in_process`` starts no Ray: every role is a plain object in the launcher's process, reached
through an :class:`InProcessActor`. Its ``handle.method.remote(...)`` runs the call at once and returns a
finished :class:`InProcessRef`, so the modes, the weight transfer, checkpoints and health code keep one
shape for both. They wait and fetch through :func:`get`, :func:`wait`, :func:`put` and :func:`kill`,
which take either kind of reference; a role's exception surfaces at :func:`get`, as Ray's does.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


class InProcessRef:
    """The finished result of a call on an :class:`InProcessActor` (its value, or the error it raised)."""

    __slots__ = ("_error", "_value")

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value


class InProcessActor:
    """A role object in this process behind the actor-handle interface (``handle.method.remote(...)``).

    Ray resolves references passed as top-level arguments before a call; so does this handle. Ray's
    ``__ray_ready__`` ping is answered: an object in this process is alive as long as the process is.
    """

    def __init__(self, role: Any) -> None:
        self.role = role

    def __getattr__(self, method: str) -> InProcessMethod:
        if method == "__ray_ready__":
            return InProcessMethod(lambda: True)
        if method.startswith("_"):  # pickling and other protocol lookups: not role methods
            raise AttributeError(method)
        return InProcessMethod(getattr(self.role, method))


class InProcessMethod:
    def __init__(self, fn: Callable[..., Any], num_returns: int = 1) -> None:
        self.fn, self.num_returns = fn, num_returns

    def options(self, num_returns: int = 1, **_scheduling: Any) -> InProcessMethod:
        """Ray's call options: only ``num_returns`` means anything here (one process, no scheduling)."""
        return InProcessMethod(self.fn, num_returns)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        try:
            value = self.fn(*map(_resolve, args), **{k: _resolve(v) for k, v in kwargs.items()})
        except Exception as err:
            if self.num_returns == 1:
                return InProcessRef(error=err)
            return tuple(InProcessRef(error=err) for _ in range(self.num_returns))
        if self.num_returns == 1:
            return InProcessRef(value)
        return tuple(InProcessRef(v) for v in value)


def _resolve(arg: Any) -> Any:
    return arg.result() if isinstance(arg, InProcessRef) else arg


def get(refs: Any, timeout: float | None = None) -> Any:
    """``ray.get`` for Ray references, in-process references, or a list of either."""
    if isinstance(refs, InProcessRef):
        return refs.result()
    if isinstance(refs, list) and any(isinstance(r, InProcessRef) for r in refs):
        return [get(r, timeout) for r in refs]
    import ray  # imported only here and below: cluster=in_process runs where Ray is not installed

    return ray.get(refs, timeout=timeout)


def wait(refs: list[Any], num_returns: int = 1, timeout: float | None = None) -> tuple[list[Any], list[Any]]:
    """``ray.wait``; in-process references are finished from the start."""
    if any(isinstance(r, InProcessRef) for r in refs):
        return refs[:num_returns], refs[num_returns:]
    import ray

    return ray.wait(refs, num_returns=num_returns, timeout=timeout)


def put(value: Any) -> Any:
    """``ray.put`` when this process runs Ray, else a reference holding ``value`` itself."""
    ray = sys.modules.get("ray")  # never imported: Ray is not running in this process
    return ray.put(value) if ray is not None and ray.is_initialized() else InProcessRef(value)


def kill(handle: Any) -> None:
    """End the role behind ``handle``: kill its Ray actor, or let the object in this process release what it
    holds outside Python objects (reward workers, engine servers) through its own ``shutdown``."""
    if isinstance(handle, InProcessActor):
        close = getattr(handle.role, "shutdown", None)
        if close is not None:
            close()
    else:
        import ray

        ray.kill(handle, no_restart=True)
