"""Runners that execute reward calls with a per-call timeout: in-process threads or a process pool.

A *call* is one invocation of a reward function (one sample, or one prompt group for a group reward).
Both runners return, per call, ``("ok", value)``, ``("timeout", None)`` or ``("error", message)``
and never raise for a failing reward.

Both run the calls of a batch concurrently, each with its own deadline counted from its start, so a
batch whose rewards all hang costs about one timeout. Why two runners: the process pool isolates the
run from its rewards (a reward that hangs has its worker killed and replaced; one that calls
``os._exit`` or segfaults costs only its own samples) and runs CPU-bound verifiers in parallel.
In-process mode cannot kill a thread (a reward that overruns is abandoned on a daemon thread and keeps
running in the background) and a reward that exits or crashes ends the whole process. Calls running
at once in one process share its CPU (the GIL): a CPU-bound reward's timeout must allow for that.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
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


# ----------------------------------------------------------------------------------- scheduling


def patience_for(timeout: float) -> float:
    """How long every running thread must be on its call before another thread joins."""
    return min(0.05, timeout / 8)


class CallThreads:
    """Runs queued calls on as few threads as keep them moving: one thread takes them one after another
    (fast rewards then cost no thread switch per sample), and whenever every thread has been on its call
    for ``patience`` seconds another joins, up to ``concurrency``. So N hung calls start within
    N·``patience`` of each other and cost about one timeout, not N.

    ``run_one(key)`` runs a call; ``report(key, status)`` receives its outcome, or ``("timeout", None)``
    once it has run ``timeout`` seconds (its thread is then abandoned: a thread cannot be killed).
    ``supervise`` keeps deadlines and adds threads; it returns once the queue is empty and nothing runs,
    unless ``forever``.
    """

    def __init__(
        self,
        run_one: Callable[[Any], Status],
        report: Callable[[Any, Status], None],
        concurrency: int,
    ) -> None:
        self.run_one, self.report, self.concurrency = run_one, report, concurrency
        self.cond = threading.Condition()
        self.todo: list[tuple[Any, float]] = []  # (key, timeout), first in first out
        self.running: dict[int, tuple[Any, float, float]] = {}  # thread id -> (key, start, timeout)
        self.live: set[int] = set()  # threads not abandoned
        self.abandoned: set[int] = set()
        self.num_abandoned = 0
        self._ids = iter(range(1 << 62))

    def put(self, key: Any, timeout: float) -> None:
        with self.cond:
            self.todo.append((key, timeout))
            self.cond.notify_all()

    def _puller(self, tid: int) -> None:
        while True:
            with self.cond:
                if tid in self.abandoned:
                    return
                if not self.todo:
                    self.running.pop(tid, None)
                    self.live.discard(tid)
                    self.cond.notify_all()
                    return
                key, timeout = self.todo.pop(0)
                self.running[tid] = (key, time.monotonic(), timeout)
            status = self.run_one(key)
            with self.cond:
                if tid in self.abandoned:  # reported as a timeout already
                    return
                del self.running[tid]
                self.report(key, status)

    def _spawn(self) -> None:
        tid = next(self._ids)
        self.live.add(tid)
        threading.Thread(target=self._puller, args=(tid,), name="relax-reward-call", daemon=True).start()

    def supervise(self, forever: bool = False) -> None:
        with self.cond:
            while True:
                now = time.monotonic()
                for tid, (key, began, timeout) in list(self.running.items()):
                    if now >= began + timeout:
                        del self.running[tid]
                        self.live.discard(tid)
                        self.abandoned.add(tid)
                        self.num_abandoned += 1
                        self.report(key, ("timeout", None))
                busy = [self.running.get(tid) for tid in self.live]
                stuck = all(b is not None and now - b[1] >= patience_for(b[2]) for b in busy)
                if self.todo and len(self.live) < self.concurrency and stuck:
                    self._spawn()
                    busy.append(None)
                if not forever and not self.todo and not self.running and not self.live:
                    return
                wake = [b[1] + b[2] for b in busy if b is not None]
                if self.todo and len(self.live) < self.concurrency:
                    wake += [b[1] + patience_for(b[2]) for b in busy if b is not None]
                if None in busy:  # a thread between calls (or starting) does not wake us: look again soon
                    wake.append(now + patience_for(min((t for _, t in self.todo), default=1.0)))
                self.cond.wait(max(0.0, min(wake) - now) if wake else None)


# ----------------------------------------------------------------------------------- in-process


class InProcessRunner:
    """Runs calls in this process on :class:`CallThreads`, up to ``concurrency`` at once.

    Each call's deadline counts from its own start, so N hung calls cost about one timeout, not N. A call
    that overruns is marked ``timeout`` and its thread abandoned (a thread cannot be killed; it keeps
    running in the background). Coroutine rewards of a batch share one event loop and run concurrently,
    each under ``asyncio.wait_for``. No crash isolation: a reward that calls ``os._exit`` or crashes the
    interpreter ends this process.
    """

    def __init__(self, concurrency: int = 64) -> None:
        self.concurrency = concurrency
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
        for i, status in zip(sync_idx, self._run_sync([calls[i] for i in sync_idx], timeout), strict=True):
            results[i] = status
        return [r if r is not None else ("error", "reward call was not run") for r in results]

    def _run_sync(self, calls: list[Call], timeout: float) -> list[Status]:
        results: list[Status | None] = [None] * len(calls)

        def run_one(i: int) -> Status:
            call = calls[i]
            try:
                return ("ok", invoke(call.fn, call.args, call.kwargs))
            except BaseException as e:  # noqa: BLE001 - any failure of user code becomes an outcome
                return ("error", describe_exception(e))

        def report(i: int, status: Status) -> None:
            if results[i] is None:
                results[i] = status

        threads = CallThreads(run_one, report, self.concurrency)
        for i in range(len(calls)):
            threads.put(i, timeout)
        threads.supervise()
        self.num_abandoned_threads += threads.num_abandoned
        return [r if r is not None else ("error", "reward call was not run") for r in results]

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
_targets_lock = threading.Lock()  # calls run on threads: one loads a file, the others wait for it


def _call_in_worker(ref: tuple[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    kind, value = ref
    if kind == "target":  # a file-loaded reward is loaded again by path in the worker
        with _targets_lock:
            if value not in _targets:
                from relax_rewards.plugins import load_custom

                _targets[value] = load_custom(value)
        value = _targets[value]
    return invoke(value, args, kwargs)


def _worker_main(conn: Connection) -> None:
    """A worker process: says "ready" once warm, then runs the calls it receives on :class:`CallThreads`
    and sends back ``(index, status)`` as each finishes, ``("timeout", None)`` for one that overran (the
    parent then kills the worker once its other calls are in: the overrunning thread cannot be stopped)."""
    _warm_worker()

    def run_one(msg: tuple[int, bytes]) -> Status:
        try:
            ref, args, kwargs = pickle.loads(msg[1])
            return ("ok", _call_in_worker(ref, args, kwargs))
        except BaseException as e:  # noqa: BLE001 - any failure of user code becomes an outcome
            return ("error", describe_exception(e))

    def report(msg: tuple[int, bytes], status: Status) -> None:
        try:
            conn.send((msg[0], status))
        except Exception as e:  # noqa: BLE001 - a returned value that cannot be pickled
            error = f"reward returned a value that cannot be sent back: {describe_exception(e)}"
            conn.send((msg[0], ("error", error)))

    threads = CallThreads(run_one, report, concurrency=1 << 30)  # the parent bounds calls in flight
    threading.Thread(target=threads.supervise, args=(True,), name="relax-reward-calls", daemon=True).start()
    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        i, payload, timeout = msg
        threads.put((i, payload), timeout)


class _Worker:
    def __init__(self, ctx: Any) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child,), name="relax-reward-worker", daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.hung = False  # a call overran: take no more calls, kill once the others are in
        self.solo = False  # running one call alone, to learn whether it is the one that kills the process
        self.inflight: dict[int, float] = {}  # call index -> start of its backstop deadline (see _send)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class ProcessPoolRunner:
    """``num_workers`` worker processes, each running up to ``concurrency`` calls at once on threads.

    Each call's deadline counts from when it is handed to a warm worker, so N hung calls cost about one
    timeout. A worker with an overrunning call takes no new calls and is killed and replaced once its
    other calls are in. A reward that exits or crashes its process costs only its own samples: the calls
    that were running beside it in the dead worker are run again one at a time, and the one that kills
    its worker again scores an error.
    """

    def __init__(self, num_workers: int, start_method: str = "spawn", concurrency: int = 64) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1 for a process pool, got {num_workers}")
        self.num_workers = num_workers
        self.concurrency = concurrency
        self.ctx = multiprocessing.get_context(start_method)
        self.num_restarts = 0
        self.timeout = 0.0  # the running batch's per-call timeout
        self._workers: list[_Worker] = []
        self._pid = os.getpid()

    def _ensure_started(self) -> None:
        if os.getpid() != self._pid:  # forked copy of a parent's executor: its workers are not ours
            self._workers, self._pid = [], os.getpid()
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self.ctx))

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._workers.remove(w)
        self.num_restarts += 1
        self._workers.append(_Worker(self.ctx))

    def run(self, calls: list[Call], timeout: float) -> list[Status]:
        self._ensure_started()
        self.timeout = timeout
        results: list[Status | None] = [None] * len(calls)
        pending = list(range(len(calls)))  # calls not yet handed out, next first
        solo: list[int] = []  # calls that were in a worker that died beside others: rerun alone
        while pending or solo or any(w.inflight for w in self._workers):
            self._dispatch(calls, pending, solo, results)
            self._collect(timeout, solo, results)
        return [r if r is not None else ("error", "reward call was not run") for r in results]

    def _dispatch(
        self, calls: list[Call], pending: list[int], solo: list[int], results: list[Status | None]
    ) -> None:
        for w in self._workers:
            if not w.ready or w.hung or w.solo:
                continue
            if solo and not w.inflight:
                self._send(w, solo.pop(0), calls, results)
                w.solo = True
                continue
            while pending and len(w.inflight) < self.concurrency:
                self._send(w, pending.pop(0), calls, results)

    def _send(self, w: _Worker, i: int, calls: list[Call], results: list[Status | None]) -> None:
        c = calls[i]
        try:
            payload = pickle.dumps((c.ref, c.args, c.kwargs))
        except Exception as e:  # noqa: BLE001 - arguments that cannot travel
            results[i] = ("error", f"reward call cannot be sent to a worker process: {describe_exception(e)}")
            return
        w.conn.send((i, payload, self.timeout))
        # the worker keeps each call's deadline from its start; this backstop (for a worker too stuck to
        # report) allows for the calls queued before it, each of which may hold a thread for the patience
        w.inflight[i] = time.monotonic() + patience_for(self.timeout) * len(w.inflight) + 1.0

    def _collect(self, timeout: float, solo: list[int], results: list[Status | None]) -> None:
        """Wait for a reply, a death or the nearest deadline, and handle whatever happened."""
        deadlines = [t + timeout for w in self._workers for t in w.inflight.values()]
        wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        handles = [w.conn for w in self._workers] + [w.proc.sentinel for w in self._workers]
        multiprocessing.connection.wait(handles, wait_s)
        for w in list(self._workers):
            try:
                while w.conn.poll():
                    msg = w.conn.recv()
                    if msg == "ready":
                        w.ready = True
                    elif w.inflight.pop(msg[0], None) is not None:
                        results[msg[0]] = msg[1]
                        w.solo = False
                        w.hung |= msg[1][0] == "timeout"
            except (EOFError, OSError):
                pass  # the process is gone; its sentinel says so below
            if not w.proc.is_alive():
                self._buried(w, solo, results)
                continue
            now = time.monotonic()
            for i in [i for i, t in w.inflight.items() if now >= t + timeout]:
                del w.inflight[i]
                results[i] = ("timeout", None)
                w.hung = True
            if w.hung and not w.inflight:
                self._replace(w)

    def _buried(self, w: _Worker, solo: list[int], results: list[Status | None]) -> None:
        """A worker process ended on its own: attribute its in-flight calls and start a replacement."""
        w.proc.join(5)
        code = w.proc.exitcode
        if not w.ready:  # it died warming up: a broken install, not a reward; do not loop restarting it
            raise RuntimeError(f"a reward worker process exited while starting (exit code {code})")
        if len(w.inflight) == 1:
            (i,) = w.inflight
            results[i] = ("error", f"reward worker process died (exit code {code})")
        else:
            solo.extend(sorted(w.inflight))
        w.inflight.clear()
        self._replace(w)

    def close(self) -> None:
        if os.getpid() != self._pid:
            return
        for w in self._workers:
            if w.proc.is_alive():
                try:
                    w.conn.send(None)
                except OSError:
                    pass
        for w in self._workers:
            w.proc.join(5)
            w.kill()
        self._workers = []
