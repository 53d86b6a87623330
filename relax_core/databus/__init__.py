"""The DataBus that carries samples between the roles of ``mode=async``.

Implementations (``mode.databus``):

* ``ray`` (default): one light Ray actor holds the partitions; starts in < 1 s with 0.1 CPU.
* ``transferqueue``: TransferQueue's controller + storage units; needs 2 extra logical CPUs and
  ~7–15 s to start on the 2-core development machine (numbers in ``benchmarks/async_vs_colocate.py``).
* ``memory``: in-process only (unit tests, single-process tools).
"""

from __future__ import annotations

from relax_core.config.options import Option
from relax_core.databus.base import (
    DataBus,
    DataBusDown,
    DataBusTimeout,
    PartitionCancelled,
    partition_name,
    sample_key,
)
from relax_core.databus.memory import InMemoryDataBus

DATABUSES = Option(
    "mode.databus",
    {
        "ray": "relax_core.databus.ray_bus:RayDataBus",
        "transferqueue": "relax_core.databus.transferqueue:TransferQueueDataBus",
        "memory": "relax_core.databus.memory:InMemoryDataBus",
    },
)
# logical CPUs each bus's own actors reserve in Ray: the ray bus's server; TransferQueue's controller and its
# one storage unit, 1 each (TransferQueue's own reservation)
BUS_CPUS = {"ray": 0.1, "transferqueue": 2.0, "memory": 0.0}


def start_databus(name: str) -> DataBus:
    """Start the bus ``mode.databus`` names in the current process / Ray cluster."""
    return DATABUSES.load(name).start()


__all__ = [
    "DATABUSES",
    "DataBus",
    "DataBusDown",
    "DataBusTimeout",
    "InMemoryDataBus",
    "PartitionCancelled",
    "partition_name",
    "sample_key",
    "start_databus",
]
