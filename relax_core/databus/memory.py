"""In-process DataBus: a dict behind a lock. Used by unit tests and inside the Ray bus server actor."""

from __future__ import annotations

import threading

from relax_core.databus.base import DataBus, Fields, PartitionCancelled


class InMemoryDataBus(DataBus):
    """Partitions in a dict of this process: roles on threads of one process (tests, in-process tools)."""

    @classmethod
    def start(cls) -> InMemoryDataBus:
        return cls()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # partition -> key -> field -> value
        self._rows: dict[str, dict[str, dict]] = {}
        # partition -> task -> consumed keys
        self._consumed: dict[str, dict[str, set[str]]] = {}
        self._cancelled: set[str] = set()

    def _check(self, partition: str) -> None:
        if partition in self._cancelled:
            raise PartitionCancelled(f"{partition} was cancelled")

    def put(self, partition: str, keys: list[str], fields: Fields) -> None:
        for name, values in fields.items():
            if len(values) != len(keys):
                raise ValueError(f"field {name!r} has {len(values)} values for {len(keys)} keys")
        with self._lock:
            self._check(partition)
            rows = self._rows.setdefault(partition, {})
            for i, key in enumerate(keys):
                row = rows.setdefault(key, {})
                for name, values in fields.items():
                    row[name] = values[i]

    def ready(self, partition: str, fields: list[str], task: str | None = None) -> list[str]:
        with self._lock:
            self._check(partition)
            rows = self._rows.get(partition, {})
            done = self._consumed.get(partition, {}).get(task, set()) if task else set()
            return sorted(k for k, row in rows.items() if k not in done and all(f in row for f in fields))

    def get(self, partition: str, keys: list[str], fields: list[str]) -> Fields:
        with self._lock:
            self._check(partition)
            rows = self._rows.get(partition, {})
            missing = [k for k in keys if k not in rows or any(f not in rows[k] for f in fields)]
            if missing:
                raise KeyError(f"{partition}: rows {missing[:3]} lack some of {fields}")
            return {f: [rows[k][f] for k in keys] for f in fields}

    def consume(self, partition: str, keys: list[str], task: str) -> None:
        with self._lock:
            self._check(partition)
            self._consumed.setdefault(partition, {}).setdefault(task, set()).update(keys)

    def consumed(self, partition: str, task: str) -> list[str]:
        with self._lock:
            return sorted(self._consumed.get(partition, {}).get(task, set()))

    def clear(self, partition: str) -> None:
        with self._lock:
            self._rows.pop(partition, None)
            self._consumed.pop(partition, None)
            self._cancelled.discard(partition)

    def cancel(self, partition: str) -> None:
        with self._lock:
            self._cancelled.add(partition)

    def partitions(self) -> list[str]:
        with self._lock:
            return sorted(p for p, rows in self._rows.items() if rows)
