"""DataBus served by one light Ray actor (an :class:`InMemoryDataBus` inside it).

Rows travel through Ray's object store; the server needs a tenth of a CPU and starts in well under a
second, which is why it is the default on small machines (see docs in :mod:`relax_core.databus`).
"""

from __future__ import annotations

import ray

from relax_core.databus.base import DataBus, Fields
from relax_core.databus.memory import InMemoryDataBus


class RayDataBus(DataBus):
    """Client of the bus server; picklable, so it is handed to every role actor."""

    def __init__(self, server: ray.actor.ActorHandle) -> None:
        self.server = server
        self._owner = False

    @classmethod
    def start(cls, num_cpus: float = 0.1, name: str | None = None) -> RayDataBus:
        server = (
            ray.remote(InMemoryDataBus).options(num_cpus=num_cpus, max_concurrency=16, name=name).remote()
        )
        ray.get(server.partitions.remote())  # raise here if it cannot start
        bus = cls(server)
        bus._owner = True
        return bus

    def __getstate__(self) -> dict:
        return {"server": self.server, "_owner": False}

    def put(self, partition: str, keys: list[str], fields: Fields) -> None:
        ray.get(self.server.put.remote(partition, keys, fields))

    def ready(self, partition: str, fields: list[str], task: str | None = None) -> list[str]:
        return ray.get(self.server.ready.remote(partition, fields, task))

    def get(self, partition: str, keys: list[str], fields: list[str]) -> Fields:
        return ray.get(self.server.get.remote(partition, keys, fields))

    def consume(self, partition: str, keys: list[str], task: str) -> None:
        ray.get(self.server.consume.remote(partition, keys, task))

    def consumed(self, partition: str, task: str) -> list[str]:
        return ray.get(self.server.consumed.remote(partition, task))

    def clear(self, partition: str) -> None:
        ray.get(self.server.clear.remote(partition))

    def partitions(self) -> list[str]:
        return ray.get(self.server.partitions.remote())

    def close(self) -> None:
        if self._owner:
            ray.kill(self.server, no_restart=True)
            self._owner = False
