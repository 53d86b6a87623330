"""Runners that execute reward calls with a per-call timeout: in-process threads or a process pool.

A *call* is one invocation of a reward function (one sample, or one prompt group for a group reward).
Both runners return, per call, ``("ok", value)``, ``("timeout", None)`` or ``("error", message)``
and never raise for a failing reward.

Why two runners: the process pool can kill a reward that hangs (its worker is killed and replaced, the
other workers keep going), and runs CPU-bound verifiers in parallel. In-process mode cannot kill a
thread; a reward that overruns is abandoned on a daemon thread (it keeps running in the background)
and the caller moves on.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("relax_rewards.executor")

Status = tuple[str, Any]


@dataclass
class Call:
    """One reward invocation. ``ref`` lets a worker process find the function: ``("fn", fn)`` (pickled
    by reference) or ``("target", "pkg.mod.fn" | "file.py:fn")`` (loaded in the worker)."""

    fn: Callable[..., Any]
    ref: tuple[str, Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def invoke(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Call a reward, awaiting it when it is a coroutine function (or returns an awaitable)."""
    result = fn(*args, **kwargs)
    if inspect.isawaitable(result):

        async def _wait() -> Any:
            return await result

        result = asyncio.run(_wait())
    return result


def describe_exception(e: BaseException) -> str:
    msg = str(e)
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


# ----------------------------------------------------------------------------------- in-process


class _SyncBatch:
    """Runs calls ``[start:]`` one after another on one daemon thread, publishing which call is
    running since when; the owner can abandon it, after which nothing it produces is kept."""

    def __init__(self, calls: list[Call], start: int, results: list[Status | None]) -> None:
        self.calls, self.results = calls, results
        self.lock = threading.Lock()
        self.abandoned = False
        self.done = threading.Event()
        self.current = (start, time.monotonic())  # (call index, start time), replaced atomically
        self.thread = threading.Thread(
            target=self._body, args=(start,), name="relax-reward-calls", daemon=True
        )
        self.thread.start()

    def _body(self, start: int) -> None:
        for i in range(start, len(self.calls)):
            self.current = (i, time.monotonic())
            call = self.calls[i]
            try:
                status: Status = ("ok", invoke(call.fn, call.args, call.kwargs))
            except BaseException as e:  # noqa: BLE001 - any failure of user code becomes an outcome
                status = ("error", describe_exception(e))
            with self.lock:
                if self.abandoned:
                    return
                self.results[i] = status
        self.done.set()


class InProcessRunner:
    """Runs calls in this process on a daemon thread, one after another, with a per-call deadline.

    The calling thread sleeps until the running call's deadline (not once per call, which would cost a
    thread switch per sample); a call that overruns is marked ``timeout`` and its thread abandoned, and
    a fresh thread continues with the next call. Coroutine rewards of a batch share one event loop and
    run concurrently (an HTTP judge does not wait for the previous sample's reply), each under
    ``asyncio.wait_for``.
    """

    def __init__(self) -> None:
        self.num_abandoned_threads = 0

    def run(self, calls: list[Call], timeout: float) -> list[Status]:
        results: list[Status | None] = [None] * len(calls)
        async_idx = [i for i, c in enumerate(calls) if inspect.iscoroutinefunction(c.fn)]
        if async_idx:
            for i, status in zip(
                async_idx, self._run_async([calls[i] for i in async_idx], timeout), strict=True
            ):
                results[i] = status
        sync_idx = [i for i in range(len(calls)) if results[i] is None]
        sync_results: list[Status | None] = [None] * len(sync_idx)
        self._run_sync([calls[i] for i in sync_idx], timeout, sync_results)
        for i, status in zip(sync_idx, sync_results, strict=True):
            results[i] = status
        return [r if r is not None else ("error", "reward call was not run") for r in results]

    def _run_sync(self, calls: list[Call], timeout: float, results: list[Status | None]) -> None:
        start = 0
        while start < len(calls):
            batch = _SyncBatch(calls, start, results)
            while True:
                _, began = batch.current
                if batch.done.wait(max(0.0, began + timeout - time.monotonic())):
                    return
                i, began = batch.current
                if time.monotonic() < began + timeout:
                    continue  # the thread moved on to a later call; wait for that one's deadline
                with batch.lock:
                    finished = results[i] is not None
                    if not finished:
                        batch.abandoned = True
                        results[i] = ("timeout", None)
                if finished:  # it completed right at the deadline; let the thread publish its next call
                    batch.done.wait(0.001)
                    continue
                self.num_abandoned_threads += 1
                start = i + 1
                break

    def _run_thread(
        self, target: Callable[[], Any], timeout: float
    ) -> tuple[bool, Any, BaseException | None]:
        box: dict[str, Any] = {}

        def body() -> None:
            try:
                box["value"] = target()
            except BaseException as e:  # noqa: BLE001
                box["error"] = e

        t = threading.Thread(target=body, name="relax-reward-async", daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            self.num_abandoned_threads += 1
            return False, None, None
        return True, box.get("value"), box.get("error")

    def _run_async(self, calls: list[Call], timeout: float) -> list[Status]:
        out: list[Status] = [("timeout", None)] * len(calls)

        async def one(i: int, call: Call) -> None:
            try:
                out[i] = ("ok", await asyncio.wait_for(call.fn(*call.args, **call.kwargs), timeout))
            except TimeoutError:
                out[i] = ("timeout", None)
            except BaseException as e:  # noqa: BLE001
                out[i] = ("error", describe_exception(e))

        async def main() -> None:
            await asyncio.gather(*(one(i, c) for i, c in enumerate(calls)))

        # a coroutine that blocks the loop (e.g. time.sleep) defeats wait_for; the thread join bounds it
        # calls still unfinished when the join gives up keep their ("timeout", None) entry
        _, _, error = self._run_thread(lambda: asyncio.run(main()), timeout + 1.0)
        if error is not None:
            return [("error", describe_exception(error))] * len(calls)
        return list(out)


# ----------------------------------------------------------------------------------- processes


def _warm_worker() -> None:
    """Worker start-up: import the heavy parts before taking work, so the first call's timeout is not spent
    on imports; Ctrl-C is the parent's to handle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import relax_rewards.builtin  # noqa: F401  (and with it the package: every built-in reward registered)

    try:
        import math_verify  # noqa: F401
        import sympy  # noqa: F401
    except ImportError:  # pragma: no cover - only the math rewards need them
        pass


_targets: dict[str, Callable[..., Any]] = {}


def _call_in_worker(ref: tuple[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    kind, value = ref
    if kind == "target":  # a file-loaded reward is loaded again by path in the worker
        if value not in _targets:
            from relax_rewards.plugins import load_custom

            _targets[value] = load_custom(value)
        value = _targets[value]
    return invoke(value, args, kwargs)


class ProcessPoolRunner:
    """``num_workers`` worker processes (a ``pebble`` pool) fed one call at a time; a worker whose call
    overruns the timeout (counted from when the worker takes the call) or that dies is killed and
    replaced, so later calls never wait on it."""

    def __init__(self, num_workers: int, start_method: str = "spawn") -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1 for a process pool, got {num_workers}")
        self.num_workers = num_workers
        self.ctx = multiprocessing.get_context(start_method)
        self.num_restarts = 0
        self._pool: Any = None
        self._pid = os.getpid()

    def _ensure_started(self) -> Any:
        from pebble import ProcessPool

        if os.getpid() != self._pid:  # forked copy of a parent's executor: its workers are not ours
            self._pool, self._pid = None, os.getpid()
        if self._pool is None:
            self._pool = ProcessPool(self.num_workers, initializer=_warm_worker, context=self.ctx)
        return self._pool

    def run(self, calls: list[Call], timeout: float) -> list[Status]:
        from pebble import ProcessExpired

        pool = self._ensure_started()
        futures = [pool.schedule(_call_in_worker, (c.ref, c.args, c.kwargs), timeout=timeout) for c in calls]
        results: list[Status] = []
        for future in futures:
            try:
                results.append(("ok", future.result()))
            except TimeoutError:
                self.num_restarts += 1
                results.append(("timeout", None))
            except ProcessExpired as e:
                self.num_restarts += 1
                results.append(("error", f"reward worker process died (exit code {e.exitcode})"))
            except BaseException as e:  # noqa: BLE001 - the reward's own error, or a value that cannot travel
                results.append(("error", describe_exception(e)))
        return results

    def close(self) -> None:
        if os.getpid() != self._pid or self._pool is None:
            return
        self._pool.close()
        self._pool.join(timeout=5)
        if self._pool.active:
            self._pool.stop()
            self._pool.join()
        self._pool = None
