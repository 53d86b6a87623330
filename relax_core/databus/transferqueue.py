"""DataBus on TransferQueue (``pip install transferqueue``): a controller plus storage-unit Ray actors.

Rows are TransferQueue keys inside a partition; each field is a TensorDict column (1-d values of different
lengths travel as jagged nested tensors). Readiness and consumption are kept in the key's tags, which
TransferQueue merges on every put: ``f:<field>`` marks a written field, ``c:<task>`` a consumed row.

TransferQueue's controller and each storage unit reserve 1 logical CPU in Ray; with one storage unit the
bus needs 2 free logical CPUs (on a 2-core machine start Ray with more logical CPUs, e.g.
``cluster.num_cpus=8``: the actors are mostly idle).

**When one of those actors dies** (TransferQueue starts them without Ray restarts), a call to it would
wait forever on its ZMQ socket. So every call runs on a worker thread, and one that has not answered within
``WATCH_S`` pings the bus's actors: if one is gone the call raises :class:`DataBusDown`, which the async
scheduler recovers from like a dead role. The driver (the bus's owner) then closes what is left and starts a
fresh, empty TransferQueue (:meth:`TransferQueueDataBus.wait_until_up`); every other process finds, at its
next call, that the actors it is attached to are gone and attaches to the new ones (checked at most once per
``WATCH_S``: on a healthy bus, two name look-ups and a ping per process every 2 s; the watched calls cost
1-2% of the bus's throughput in ``benchmarks/async_vs_colocate.py``).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError

from relax_core.databus.base import DataBus, DataBusDown, Fields, PartitionCancelled
from relax_core.errors import RelaxUserError

# a cancelled partition holds this key, tagged CANCEL_TAG
CANCEL_KEY, CANCEL_TAG = "~cancelled", "cancelled"
# TransferQueue's named actors: its controller, and storage unit i (in the run's namespace)
CONTROLLER, CONTROLLER_NAMESPACE = "TransferQueueController", "transfer_queue"
STORAGE_UNIT = "TransferQueueStorageUnit#{}"
# a call this slow (s) makes its process check that the bus's actors are alive; also the least time between
# two checks before calls
WATCH_S = 2.0
# how long a live but busy actor may take to answer the check's ping (s)
PING_TIMEOUT_S = 30.0

log = logging.getLogger("relax")
# TransferQueue sets its loggers' level from this when its modules are imported (its storage units get it from
# the launcher's job environment); it warns on every call that its default of 8 threads exceeds the cores
os.environ.setdefault("TQ_LOGGING_LEVEL", "ERROR")


class _CallThread:
    """A daemon thread that runs this process's calls to TransferQueue in order. A daemon, so that a call
    blocked forever on a dead actor does not keep the process from exiting."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True, name="relax-tq").start()

    def submit(self, fn, kwargs: dict) -> Future:
        future: Future = Future()
        self._queue.put((fn, kwargs, future))
        return future

    def stop(self) -> None:
        self._queue.put(None)  # the thread ends after the call it is in, if that ever returns

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, kwargs, future = item
            try:
                future.set_result(fn(**kwargs))
            except BaseException as err:  # noqa: BLE001  (handed to the caller)
                future.set_exception(err)


class _ProcessClient:
    """This process's attachment to TransferQueue. TransferQueue keeps one client per process (module
    globals), so the state lives here, shared by every bus object of the process (roles that share one)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.attached: tuple | None = None  # ids of the actors the client talks to
        self.checked_at = -WATCH_S
        self.thread: _CallThread | None = None


_PROCESS = _ProcessClient()


class TransferQueueDataBus(DataBus):
    def __init__(self, num_storage_units: int = 1) -> None:
        self.num_storage_units = num_storage_units
        self._owner = False

    @classmethod
    def start(cls, num_storage_units: int = 1) -> TransferQueueDataBus:
        """Start TransferQueue's controller and storage in the current Ray cluster."""
        need = 1.0 + num_storage_units
        free = ray.available_resources().get("CPU", 0.0)
        if free < need:
            raise RelaxUserError(
                f"mode.databus=transferqueue needs {need:g} free logical CPUs in Ray for its controller and "
                f"storage units, only {free:g} are free: raise cluster.num_cpus (e.g. cluster.num_cpus=8) "
                "or use mode.databus=ray"
            )
        bus = cls(num_storage_units)
        bus._owner = True
        bus._start_actors()
        return bus

    def __getstate__(self) -> dict:
        return {"num_storage_units": self.num_storage_units}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["num_storage_units"])

    # ------------------------------------------------------------------ the actors and this process's client
    def _start_actors(self) -> None:
        import transfer_queue as tq
        from omegaconf import OmegaConf

        units = {"num_data_storage_units": self.num_storage_units}
        tq.init(OmegaConf.create({"backend": {"SimpleStorage": units}}))
        _PROCESS.attached, _PROCESS.checked_at = _ids(self._live_actors()), time.monotonic()

    def _stop_actors(self, timeout_s: float) -> None:
        """Kill what is left of the bus's actors (by name: this process's handles may be gone) and wait
        until their names are free for a new start."""
        from transfer_queue import interface

        deadline = time.monotonic() + timeout_s
        names = [(CONTROLLER, CONTROLLER_NAMESPACE)]
        names += [(STORAGE_UNIT.format(i), None) for i in range(self.num_storage_units)]
        for name, namespace in names:
            while True:
                try:
                    ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
                except ValueError:
                    break  # gone
                if time.monotonic() > deadline:
                    raise DataBusDown(f"TransferQueue's {name} did not stop within {timeout_s:.0f}s")
                time.sleep(0.2)
        self._detach()
        interface._TQ_STORAGE = None

    def _live_actors(self) -> list[ray.actor.ActorHandle]:
        """The bus's actors, found by name and pinged; :class:`DataBusDown` when one is gone. A busy one that
        answers late counts as alive."""
        try:
            named = [ray.get_actor(CONTROLLER, namespace=CONTROLLER_NAMESPACE)]
            named += [ray.get_actor(STORAGE_UNIT.format(i)) for i in range(self.num_storage_units)]
            ray.get([a.__ray_ready__.remote() for a in named], timeout=PING_TIMEOUT_S)
        except (ValueError, RayActorError) as err:
            raise DataBusDown(f"an actor of TransferQueue is gone ({type(err).__name__})") from err
        except GetTimeoutError:
            pass
        return named

    def _healthy(self) -> bool:
        """This process's client talks to the bus's actors, and they are alive."""
        try:
            return _ids(self._live_actors()) == _PROCESS.attached
        except DataBusDown:
            return False

    def _attach(self) -> _CallThread:
        """The thread for this process's calls, with its client on the running actors: a client left on actors
        that died since the last check is dropped, and attached to the new ones."""
        import transfer_queue as tq

        with _PROCESS.lock:
            if time.monotonic() - _PROCESS.checked_at >= WATCH_S:
                actors = self._live_actors()  # DataBusDown while the bus is down
                if _ids(actors) != _PROCESS.attached:
                    self._detach()
                    tq.init()  # attaches this process to the running controller
                    _PROCESS.attached = _ids(actors)
                _PROCESS.checked_at = time.monotonic()
            if _PROCESS.thread is None:
                _PROCESS.thread = _CallThread()
            return _PROCESS.thread

    def _detach(self) -> None:
        """Forget this process's client without touching the actors (``tq.close()`` would kill the
        controller). Its sockets may be blocked on a dead peer, so it is closed on a thread nobody waits for."""
        from transfer_queue import interface

        client = interface._TQ_CLIENT
        interface._TQ_CLIENT = interface._TQ_CONTROLLER = None
        if client is not None:
            threading.Thread(target=client.close, daemon=True).start()
        if _PROCESS.thread is not None:
            _PROCESS.thread.stop()
            _PROCESS.thread = None
        _PROCESS.attached = None

    def _call(self, name: str, **kwargs: Any) -> Any:
        """``transfer_queue.<name>(**kwargs)``, watched: when it hangs because an actor of the bus died, it
        raises :class:`DataBusDown`."""
        import transfer_queue as tq

        future = self._attach().submit(getattr(tq, name), kwargs)
        while True:
            try:
                return future.result(timeout=WATCH_S)
            except FutureTimeout:
                with _PROCESS.lock:
                    if self._healthy():
                        continue
                    self._detach()
                raise DataBusDown(f"an actor of TransferQueue died during {name}") from None

    def wait_until_up(self, timeout_s: float = 300.0) -> None:
        """In the process that started the bus: when one of its actors died, stop the others and start a
        fresh, empty TransferQueue (every other process attaches to it at its next call)."""
        if not self._owner:
            return
        with _PROCESS.lock:
            if self._healthy():
                return
            log.warning("health: an actor of TransferQueue died; starting a fresh TransferQueue")
            self._stop_actors(timeout_s)
            self._start_actors()

    @staticmethod
    def _column(values: list[torch.Tensor]) -> torch.Tensor:
        if all(v.dim() == 0 for v in values):
            return torch.stack(values)
        return torch.nested.nested_tensor([v.reshape(-1) for v in values], layout=torch.jagged)

    def put(self, partition: str, keys: list[str], fields: Fields) -> None:
        from tensordict import TensorDict

        columns = {name: self._column(values) for name, values in fields.items()}
        tags = [{f"f:{name}": 1 for name in fields} for _ in keys]
        self._call(
            "kv_batch_put",
            keys=list(keys),
            partition_id=partition,
            fields=TensorDict(columns, batch_size=len(keys)),
            tags=tags,
        )

    def _tags(self, partition: str, check: bool = True) -> dict[str, dict]:
        listing = self._call("kv_list", partition_id=partition)
        tags = listing.get(partition, {}) or {}
        if check and CANCEL_TAG in tags.get(CANCEL_KEY, {}):
            raise PartitionCancelled(f"{partition} was cancelled")
        return tags

    def cancel(self, partition: str) -> None:
        self._call("kv_batch_put", keys=[CANCEL_KEY], partition_id=partition, tags=[{CANCEL_TAG: 1}])

    def ready(self, partition: str, fields: list[str], task: str | None = None) -> list[str]:
        wanted = [f"f:{f}" for f in fields]
        done = f"c:{task}" if task else None
        return sorted(
            k
            for k, tags in self._tags(partition).items()
            if all(w in tags for w in wanted) and (done is None or done not in tags)
        )

    def get(self, partition: str, keys: list[str], fields: list[str]) -> Fields:
        td = self._call("kv_batch_get", keys=list(keys), partition_id=partition, select_fields=list(fields))
        if td.batch_size[0] != len(keys):
            raise KeyError(f"{partition}: rows {keys[:3]} lack some of {fields}")
        out: Fields = {}
        for name in fields:
            col = td[name]
            out[name] = list(col.unbind(0)) if not col.is_nested else [t for t in col.unbind()]
        return out

    def consume(self, partition: str, keys: list[str], task: str) -> None:
        self._call(
            "kv_batch_put", keys=list(keys), partition_id=partition, tags=[{f"c:{task}": 1} for _ in keys]
        )

    def consumed(self, partition: str, task: str) -> list[str]:
        return sorted(k for k, tags in self._tags(partition).items() if f"c:{task}" in tags)

    def clear(self, partition: str) -> None:
        keys = list(self._tags(partition, check=False))
        if keys:
            self._call("kv_clear", keys=keys, partition_id=partition)

    def partitions(self) -> list[str]:
        return sorted(p for p, rows in self._call("kv_list").items() if rows)

    def close(self) -> None:
        if self._owner:
            import transfer_queue as tq

            tq.close()
            self._owner = False
            self._detach()  # the client is closed; stop the call thread and forget the actors


def _ids(actors: list[ray.actor.ActorHandle]) -> tuple:
    return tuple(a._actor_id for a in actors)
