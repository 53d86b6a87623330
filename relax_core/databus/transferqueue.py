"""DataBus on TransferQueue (``pip install transferqueue``): a controller plus storage-unit Ray actors.

Rows are TransferQueue keys inside a partition; each field is a TensorDict column (1-d values of different
lengths travel as jagged nested tensors). Readiness and consumption are kept in the key's tags, which
TransferQueue merges on every put: ``f:<field>`` marks a written field, ``c:<task>`` a consumed row.

TransferQueue's controller and each storage unit reserve 1 logical CPU in Ray; with one storage unit the
bus needs 2 free logical CPUs (on a 2-core machine start Ray with more logical CPUs, e.g.
``cluster.num_cpus=8``: the actors are mostly idle).
"""

from __future__ import annotations

import logging
import os

import ray
import torch

from relax_core.databus.base import DataBus, Fields, PartitionCancelled
from relax_core.errors import RelaxUserError

# logical CPUs TransferQueue's own actors reserve: controller + one storage unit
TQ_CPUS = 2.0
# a cancelled partition holds this key, tagged CANCEL_TAG
CANCEL_KEY, CANCEL_TAG = "~cancelled", "cancelled"


class TransferQueueDataBus(DataBus):
    def __init__(self) -> None:
        self._owner = False
        self._ready_client = False

    @classmethod
    def start(cls, num_storage_units: int = 1) -> TransferQueueDataBus:
        """Start TransferQueue's controller and storage in the current Ray cluster."""
        import transfer_queue as tq
        from omegaconf import OmegaConf

        need = 1.0 + num_storage_units
        free = ray.available_resources().get("CPU", 0.0)
        if free < need:
            raise RelaxUserError(
                f"mode.databus=transferqueue needs {need:g} free logical CPUs in Ray for its controller and "
                f"storage units, only {free:g} are free: raise cluster.num_cpus (e.g. cluster.num_cpus=8) "
                "or use mode.databus=ray"
            )
        logging.getLogger("transfer_queue").setLevel(logging.ERROR)
        tq.init(
            OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": num_storage_units}}})
        )
        bus = cls()
        bus._owner = True
        bus._ready_client = True
        return bus

    def __getstate__(self) -> dict:
        return {"_owner": False, "_ready_client": False}

    def _tq(self):
        import transfer_queue as tq

        if not self._ready_client:
            os.environ.setdefault("TQ_LOG_LEVEL", "ERROR")
            tq.init()  # attaches this process to the running controller
            self._ready_client = True
        return tq

    @staticmethod
    def _column(values: list[torch.Tensor]) -> torch.Tensor:
        if all(v.dim() == 0 for v in values):
            return torch.stack(values)
        return torch.nested.nested_tensor([v.reshape(-1) for v in values], layout=torch.jagged)

    def put(self, partition: str, keys: list[str], fields: Fields) -> None:
        from tensordict import TensorDict

        tq = self._tq()
        columns = {name: self._column(values) for name, values in fields.items()}
        tags = [{f"f:{name}": 1 for name in fields} for _ in keys]
        tq.kv_batch_put(
            keys=list(keys),
            partition_id=partition,
            fields=TensorDict(columns, batch_size=len(keys)),
            tags=tags,
        )

    def _tags(self, partition: str, check: bool = True) -> dict[str, dict]:
        listing = self._tq().kv_list(partition_id=partition)
        tags = listing.get(partition, {}) or {}
        if check and CANCEL_TAG in tags.get(CANCEL_KEY, {}):
            raise PartitionCancelled(f"{partition} was cancelled")
        return tags

    def cancel(self, partition: str) -> None:
        self._tq().kv_batch_put(keys=[CANCEL_KEY], partition_id=partition, tags=[{CANCEL_TAG: 1}])

    def ready(self, partition: str, fields: list[str], task: str | None = None) -> list[str]:
        wanted = [f"f:{f}" for f in fields]
        done = f"c:{task}" if task else None
        return sorted(
            k
            for k, tags in self._tags(partition).items()
            if all(w in tags for w in wanted) and (done is None or done not in tags)
        )

    def get(self, partition: str, keys: list[str], fields: list[str]) -> Fields:
        td = self._tq().kv_batch_get(keys=list(keys), partition_id=partition, select_fields=list(fields))
        if td.batch_size[0] != len(keys):
            raise KeyError(f"{partition}: rows {keys[:3]} lack some of {fields}")
        out: Fields = {}
        for name in fields:
            col = td[name]
            out[name] = list(col.unbind(0)) if not col.is_nested else [t for t in col.unbind()]
        return out

    def consume(self, partition: str, keys: list[str], task: str) -> None:
        self._tq().kv_batch_put(
            keys=list(keys), partition_id=partition, tags=[{f"c:{task}": 1} for _ in keys]
        )

    def consumed(self, partition: str, task: str) -> list[str]:
        return sorted(k for k, tags in self._tags(partition).items() if f"c:{task}" in tags)

    def clear(self, partition: str) -> None:
        keys = list(self._tags(partition, check=False))
        if keys:
            self._tq().kv_clear(keys=keys, partition_id=partition)

    def partitions(self) -> list[str]:
        return sorted(p for p, rows in self._tq().kv_list().items() if rows)

    def close(self) -> None:
        if self._owner:
            import transfer_queue as tq

            tq.close()
            self._owner = False
