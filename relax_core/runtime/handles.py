"""Role handles that are called the same way whether the role is a Ray actor or an object in this process.

``cluster=in_process`` starts no Ray: every role is a plain object in the launcher's process, reached
through an :class:`InProcessActor`. Its ``handle.method.remote(...)`` runs the call (at once, or on the
actor's threads) and returns an :class:`InProcessRef`, so the modes, the weight transfer, checkpoints and
health code keep one shape for both. They wait and fetch through :func:`get`, :func:`wait`, :func:`put`
and :func:`kill`, which take either kind of reference; a role's exception surfaces at :func:`get`, as
Ray's does.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any


class InProcessRef:
    """The result of a call on an :class:`InProcessActor`: its value or the error it raised, or, for an
    actor with threads, the ``future`` of the call (``index``: which of its ``num_returns`` values)."""

    __slots__ = ("_error", "_future", "_index", "_value")

    def __init__(
        self,
        value: Any = None,
        error: BaseException | None = None,
        future: Future | None = None,
        index: int | None = None,
    ) -> None:
        self._value, self._error, self._future, self._index = value, error, future, index

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def result(self, timeout: float | None = None) -> Any:
        if self._future is not None:
            try:
                value = self._future.result(timeout)
            except FutureTimeout:
                raise TimeoutError(f"an in-process call did not finish within {timeout} s") from None
            return value if self._index is None else value[self._index]
        if self._error is not None:
            raise self._error
        return self._value


class InProcessActor:
    """A role object in this process behind the actor-handle interface (``handle.method.remote(...)``).

    With ``threads=0`` a call runs at once in the caller's thread (``mode=colocate``: one thing at a time).
    With ``threads=k`` it runs on the actor's own pool of ``k`` threads, as a Ray actor with
    ``max_concurrency=k`` runs its calls, so roles work side by side (``mode=async``); the reference is
    finished when the call is. Ray resolves references passed as top-level arguments before a call; so
    does this handle (on the actor's thread). Ray's ``__ray_ready__`` ping is answered: an object in this
    process is alive as long as the process is.
    """

    def __init__(self, role: Any, threads: int = 0, name: str = "role") -> None:
        self.role = role
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix=name) if threads else None

    def __getattr__(self, method: str) -> InProcessMethod:
        if method == "__ray_ready__":
            return InProcessMethod(lambda: True)
        if method.startswith("_"):  # pickling and other protocol lookups: not role methods
            raise AttributeError(method)
        return InProcessMethod(getattr(self.role, method), pool=self.pool)


class InProcessMethod:
    def __init__(
        self, fn: Callable[..., Any], num_returns: int = 1, pool: ThreadPoolExecutor | None = None
    ) -> None:
        self.fn, self.num_returns, self.pool = fn, num_returns, pool

    def options(self, num_returns: int = 1, **_scheduling: Any) -> InProcessMethod:
        """Ray's call options: only ``num_returns`` means anything here (one process, no scheduling)."""
        return InProcessMethod(self.fn, num_returns, self.pool)

    def _call(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        return self.fn(*map(_resolve, args), **{k: _resolve(v) for k, v in kwargs.items()})

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        if self.pool is not None:
            future = self.pool.submit(self._call, args, kwargs)
            if self.num_returns == 1:
                return InProcessRef(future=future)
            return tuple(InProcessRef(future=future, index=i) for i in range(self.num_returns))
        try:
            value = self._call(args, kwargs)
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
        return refs.result(timeout)
    if isinstance(refs, list) and (not refs or any(isinstance(r, InProcessRef) for r in refs)):
        deadline = None if timeout is None else time.monotonic() + timeout
        return [get(r, None if deadline is None else max(deadline - time.monotonic(), 0.0)) for r in refs]
    import ray  # imported only here and below: cluster=in_process runs where Ray is not installed

    return ray.get(refs, timeout=timeout)


def wait(refs: list[Any], num_returns: int = 1, timeout: float | None = None) -> tuple[list[Any], list[Any]]:
    """``ray.wait``; an in-process reference is finished when its call is (at once without threads)."""
    if not refs or any(isinstance(r, InProcessRef) for r in refs):
        if refs and not 0 < num_returns <= len(refs):
            raise ValueError(f"num_returns={num_returns} for {len(refs)} references")  # as Ray's
        deadline = None if timeout is None else time.monotonic() + timeout
        while refs and sum(r.done() for r in refs) < num_returns:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            pending = [r._future for r in refs if not r.done()]
            futures.wait(pending, timeout=left, return_when=futures.FIRST_COMPLETED)
        done = [r for r in refs if r.done()][:num_returns]
        return done, [r for r in refs if r not in done]
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
        if handle.pool is not None:  # a call still running keeps its thread until it returns
            handle.pool.shutdown(wait=False, cancel_futures=True)
    else:
        import ray

        ray.kill(handle, no_restart=True)
