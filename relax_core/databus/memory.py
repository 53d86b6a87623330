"""In-process DataBus: a dict behind a lock. Used by unit tests and inside the Ray bus server actor."""

from __future__ import annotations

import threading
import time
from collections.abc import Collection

from relax_core.databus.base import DataBus, DataBusTimeout, Fields, PartitionCancelled, waited_too_long


class InMemoryDataBus(DataBus):
    """Partitions in a dict of this process: roles on threads of one process (tests, in-process tools)."""

    @classmethod
    def start(cls) -> InMemoryDataBus:
        return cls()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # notified on every write, cancel and clear: a waiting consumer wakes as soon as its rows land
        self._changed = threading.Condition(self._lock)
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
            self._changed.notify_all()

    def ready(self, partition: str, fields: list[str], task: str | None = None) -> list[str]:
        with self._lock:
            return self._ready(partition, fields, task)

    def _ready(
        self, partition: str, fields: list[str], task: str | None, among: Collection[str] | None = None
    ) -> list[str]:
        self._check(partition)
        rows = self._rows.get(partition, {})
        done = self._consumed.get(partition, {}).get(task, set()) if task else set()
        keys = (k for k, row in rows.items() if k not in done and all(f in row for f in fields))
        return sorted(k for k in keys if among is None or k in among)

    def wait_ready(
        self,
        partition: str,
        fields: list[str],
        task: str | None,
        min_count: int,
        timeout_s: float | None = None,
        among: Collection[str] | None = None,
    ) -> list[str]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._changed:
            while len(keys := self._ready(partition, fields, task, among)) < min_count:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise DataBusTimeout(waited_too_long(partition, len(keys), min_count, fields, timeout_s))
                self._changed.wait(left)
            return keys

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
            self._changed.notify_all()

    def cancel(self, partition: str) -> None:
        with self._lock:
            self._cancelled.add(partition)
            self._changed.notify_all()  # its waiters raise PartitionCancelled

    def partitions(self) -> list[str]:
        with self._lock:
            return sorted(p for p, rows in self._rows.items() if rows)
