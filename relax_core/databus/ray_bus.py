"""DataBus served by one light Ray actor (an :class:`InMemoryDataBus` inside it).

Rows travel through Ray's object store packed per field (one flat tensor plus lengths): pickling a
step's ~900 small per-row tensors one by one cost 0.15-0.6 s per put or get on the 2-core machine,
more than a whole colocate step; packed, it is a few milliseconds. The server needs a tenth of a CPU and
starts in well under a second, which is why it is the default on small machines (see
:mod:`relax_core.databus`).
"""

from __future__ import annotations

import time

import ray
import torch

from relax_core.databus.base import DataBus, Fields
from relax_core.databus.memory import InMemoryDataBus

# one field of many rows: (0-d values stacked, None) or (1-d values concatenated, their lengths)
Packed = dict[str, tuple[torch.Tensor, list[int] | None]]


def pack(fields: Fields) -> Packed:
    """One tensor per field, so a transfer pickles a handful of tensors instead of one per row and field."""
    out: Packed = {}
    for name, values in fields.items():
        if values and all(v.dim() == 0 for v in values):
            out[name] = (torch.stack(values), None)
        else:
            flat = [v.reshape(-1) for v in values]
            out[name] = (torch.cat(flat) if flat else torch.empty(0), [len(v) for v in flat])
    return out


def unpack(packed: Packed) -> Fields:
    """Inverse of :func:`pack` (rows are views into the field's tensor)."""
    return {
        name: list(data.unbind(0)) if lengths is None else list(torch.split(data, lengths))
        for name, (data, lengths) in packed.items()
    }


class BusServer(InMemoryDataBus):
    """The bus actor: an in-memory bus that sends and receives rows packed."""

    def put_packed(self, partition: str, keys: list[str], packed: Packed) -> None:
        self.put(partition, keys, unpack(packed))

    def get_packed(self, partition: str, keys: list[str], fields: list[str]) -> Packed:
        return pack(self.get(partition, keys, fields))


class RayDataBus(DataBus):
    """Client of the bus server; picklable, so it is handed to every role actor."""

    def __init__(self, server: ray.actor.ActorHandle) -> None:
        self.server = server
        self._owner = False

    @classmethod
    def start(cls, num_cpus: float = 0.1, name: str | None = "databus") -> RayDataBus:
        """The bus server as a Ray actor (``name``: how resilience tools find it), and its client."""
        # a killed server is restarted by Ray with empty partitions (same handle for every role); the
        # async scheduler then regenerates the steps that were in flight
        server = (
            ray.remote(BusServer)
            .options(num_cpus=num_cpus, max_concurrency=16, name=name, max_restarts=-1)
            .remote()
        )
        ray.get(server.partitions.remote())  # raise here if it cannot start
        bus = cls(server)
        bus._owner = True
        return bus

    def __getstate__(self) -> dict:
        return {"server": self.server, "_owner": False}

    def put(self, partition: str, keys: list[str], fields: Fields) -> None:
        ray.get(self.server.put_packed.remote(partition, keys, pack(fields)))

    def ready(self, partition: str, fields: list[str], task: str | None = None) -> list[str]:
        return ray.get(self.server.ready.remote(partition, fields, task))

    def get(self, partition: str, keys: list[str], fields: list[str]) -> Fields:
        return unpack(ray.get(self.server.get_packed.remote(partition, keys, fields)))

    def consume(self, partition: str, keys: list[str], task: str) -> None:
        ray.get(self.server.consume.remote(partition, keys, task))

    def consumed(self, partition: str, task: str) -> list[str]:
        return ray.get(self.server.consumed.remote(partition, task))

    def clear(self, partition: str) -> None:
        ray.get(self.server.clear.remote(partition))

    def cancel(self, partition: str) -> None:
        ray.get(self.server.cancel.remote(partition))

    def partitions(self) -> list[str]:
        return ray.get(self.server.partitions.remote())

    def wait_until_up(self, timeout_s: float = 300.0) -> None:
        """Ray restarts a killed server (``max_restarts``); calls fail fast until it is back."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ray.get(self.server.partitions.remote(), timeout=timeout_s)
                return
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def close(self) -> None:
        if self._owner:
            ray.kill(self.server, no_restart=True)
            self._owner = False
