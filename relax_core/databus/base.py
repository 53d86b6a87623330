"""The DataBus interface: per-step partitions of samples whose fields are written by different roles.

A partition (``train_{step}``) holds one row per sample, keyed by its position in the step. Roles add
columns as they finish their part (Rollout: tokens, masks, rollout log-probs, rewards; ActorFwd: old
log-probs; Reference: ref log-probs; Advantages: advantages). A consumer asks which rows already have
every field it needs and that it has not consumed yet (:meth:`DataBus.ready`), reads them, and marks them
consumed for its task, so each role processes every row exactly once and can start on the first rows of
a step before the last ones exist.

Values are per-sample tensors (0-d scalars or 1-d sequences of any length).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Collection

import torch

Fields = dict[str, list[torch.Tensor]]


def partition_name(step: int) -> str:
    return f"train_{step}"


def sample_key(position: int) -> str:
    """Row key of the sample at ``position`` in its step; keys sort in step order."""
    return f"{position:07d}"


class DataBusTimeout(TimeoutError):
    """A consumer waited longer than its timeout for rows that never became ready."""


class DataBusDown(RuntimeError):
    """A process of the bus died under a call: whether the call took effect is unknown. The scheduler
    recovers as from a dead role (:meth:`DataBus.wait_until_up` brings the bus back, empty)."""


class PartitionCancelled(RuntimeError):
    """The partition was cancelled (its step is being regenerated after a failure): stop working on it."""


class DataBus(abc.ABC):
    """Samples of in-flight steps, with per-field readiness and per-task consumption."""

    @abc.abstractmethod
    def put(self, partition: str, keys: list[str], fields: Fields) -> None:
        """Write (or add) ``fields`` for ``keys``; ``fields[name][i]`` belongs to ``keys[i]``."""

    @abc.abstractmethod
    def ready(self, partition: str, fields: list[str], task: str | None = None) -> list[str]:
        """Sorted keys that hold every one of ``fields`` and that ``task`` has not consumed."""

    @abc.abstractmethod
    def get(self, partition: str, keys: list[str], fields: list[str]) -> Fields:
        """``fields`` of ``keys``, in the order of ``keys``."""

    @abc.abstractmethod
    def consume(self, partition: str, keys: list[str], task: str) -> None:
        """Mark ``keys`` as processed by ``task`` (they stop appearing in its :meth:`ready`)."""

    @abc.abstractmethod
    def consumed(self, partition: str, task: str) -> list[str]:
        """Sorted keys ``task`` has consumed."""

    @abc.abstractmethod
    def clear(self, partition: str) -> None:
        """Drop the partition and everything in it (a cancelled partition becomes usable again)."""

    @abc.abstractmethod
    def cancel(self, partition: str) -> None:
        """From now until :meth:`clear`, :meth:`ready` on ``partition`` raises :class:`PartitionCancelled`
        (the in-memory and Ray buses also refuse put, get and consume), so the roles still working on it
        stop instead of waiting forever for rows that will not come."""

    @abc.abstractmethod
    def partitions(self) -> list[str]:
        """Names of the partitions that hold data."""

    def close(self) -> None:
        """Release the bus's processes (only the process that started it does anything)."""

    def wait_until_up(self, timeout_s: float = 300.0) -> None:
        """Return once the bus answers again; called by the process that started it, after a failure (a
        bus process that died is restarted, by Ray or by this call)."""

    def wait_ready(
        self,
        partition: str,
        fields: list[str],
        task: str | None,
        min_count: int,
        timeout_s: float | None = None,
        among: Collection[str] | None = None,
    ) -> list[str]:
        """Block until at least ``min_count`` keys are :meth:`ready` (only keys in ``among`` count, when
        given); return them all. ``timeout_s=None`` waits until they are, or until the partition is
        cancelled (:class:`PartitionCancelled`): a rollout may rightly take longer than any fixed bound.

        This default polls with a backoff up to 50 ms, so an idle consumer costs little CPU; the in-memory
        bus wakes the waiter as soon as a write lands instead.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        delay = 0.005
        while True:
            keys = self.ready(partition, fields, task)
            if among is not None:
                keys = [k for k in keys if k in among]
            if len(keys) >= min_count:
                return keys
            if deadline is not None and time.monotonic() > deadline:
                raise DataBusTimeout(waited_too_long(partition, len(keys), min_count, fields, timeout_s))
            time.sleep(delay)
            delay = min(delay * 1.5, 0.05)


def waited_too_long(partition: str, have: int, want: int, fields: list[str], timeout_s: float) -> str:
    return f"{partition}: {have}/{want} rows with fields {fields} after {timeout_s:g} s"
