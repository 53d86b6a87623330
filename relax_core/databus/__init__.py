"""The DataBus that carries samples between the roles of ``mode=async``.

Implementations (``mode.databus``):

* ``ray`` (default): one light Ray actor holds the partitions; starts in < 1 s with 0.1 CPU.
* ``transferqueue``: TransferQueue's controller + storage units; needs 2 extra logical CPUs and
  ~7–15 s to start on the 2-core development machine (numbers in ``benchmarks/async_vs_colocate.py``).
* ``memory``: in-process only (unit tests, single-process tools).
"""

from __future__ import annotations

from relax_core.databus.base import (
    DataBus,
    DataBusDown,
    DataBusTimeout,
    PartitionCancelled,
    partition_name,
    sample_key,
)
from relax_core.databus.memory import InMemoryDataBus
from relax_core.errors import RelaxUserError

DATABUS_CHOICES = ["ray", "transferqueue", "memory"]
# logical CPUs each bus's own actors reserve in Ray: the ray bus's server; TransferQueue's controller and its
# one storage unit, 1 each (TransferQueue's own reservation)
BUS_CPUS = {"ray": 0.1, "transferqueue": 2.0, "memory": 0.0}


def start_databus(name: str) -> DataBus:
    """Start the bus ``mode.databus`` names in the current process / Ray cluster."""
    if name == "ray":
        from relax_core.databus.ray_bus import RayDataBus

        return RayDataBus.start(num_cpus=BUS_CPUS["ray"], name="databus")
    if name == "transferqueue":
        from relax_core.databus.transferqueue import TransferQueueDataBus

        return TransferQueueDataBus.start()
    if name == "memory":
        return InMemoryDataBus()
    raise RelaxUserError(f"mode.databus={name!r} is not one of {DATABUS_CHOICES}")


__all__ = [
    "DATABUS_CHOICES",
    "DataBus",
    "DataBusDown",
    "DataBusTimeout",
    "InMemoryDataBus",
    "PartitionCancelled",
    "partition_name",
    "sample_key",
    "start_databus",
]
