"""Driver side of weight transfer: :class:`WeightTransfer` publishes versions of the source's weights to
named consumer sets through one strategy (see :mod:`relax_core.weight_transfer.base`)."""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import TYPE_CHECKING, Any

from relax_core import handles
from relax_core.weight_transfer.base import TransferStats, WeightReceiver, WeightSource
from relax_core.weight_transfer.channel import Layout, layout_of, plan_buckets

if TYPE_CHECKING:
    import ray

log = logging.getLogger("relax")

STRATEGIES = ["auto", "shared_memory", "object_store", "collective", "disk"]


class WeightTransfer:
    """Publishes policy versions from ``source`` (a RoleGroup of :class:`WeightSource` ranks; rank 0 holds
    the weights) to consumer sets (lists of :class:`WeightReceiver` actor handles) through ``strategy``.

    ``publish_refs`` starts a publish and returns the refs that finish when every consumer loaded it, so
    async mode can overlap it with training; ``publish`` waits. ``deliver`` brings one consumer outside the
    sets (an engine added by scale-out, a replica restarted in place) to the newest version.
    """

    def __init__(self, strategy: str, source, cfg, run_dir: str, model_path: str) -> None:
        self.strategy = strategy
        self.source = source
        self.bucket_mb = cfg.bucket_mb
        self.run_dir = run_dir
        self.model_path = model_path
        self.sets: dict[str, list[Any]] = {}
        self.stats = TransferStats()
        self._latest: tuple[int, Any] | None = None  # (version, payload ref) of the newest publish
        self._sent_bytes: ray.ObjectRef | None = None  # what the newest publish moved (the source says)
        self._tag = f"relax-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._layout: Layout | None = None

    @property
    def layout(self) -> Layout:
        if self._layout is None:
            # gathering the weights is collective on sharded (FSDP / megatron) Actors: every rank takes part
            self._layout = handles.get(self.source.call("weights_layout"))[0]
        return self._layout

    def _spec(self, name: str, members: int, consumers: list[Any] | None = None) -> Any:
        if self.strategy == "shared_memory":
            from relax_core.weight_transfer.shared_memory import SharedMemorySpec, remove_orphans

            remove_orphans()
            return SharedMemorySpec(f"/dev/shm/{self._tag}-{name}", self.layout)
        if self.strategy == "collective":
            from relax_core.weight_transfer.collective import SyncSpec, collective_backend

            host, port = handles.get(self.source.actors[0].free_address.remote())
            # from what the members were given, not from the driver's devices
            reports = handles.get(
                [m.device_report.remote() for m in [self.source.actors[0], *(consumers or [])]]
            )
            backend = collective_backend(reports)
            log.info("weight broadcast group %s: %s over %s", name, backend, reports)
            return SyncSpec(name, host, port, members + 1, self.layout, self.bucket_mb, backend)
        if self.strategy == "in_process":
            from relax_core.weight_transfer.in_process import InProcessSpec

            return InProcessSpec(f"{self._tag}-{name}")
        if self.strategy == "disk":
            from relax_core.weight_transfer.disk import DiskSpec

            return DiskSpec(f"{self.run_dir}/rollout_weights/{name}", self.model_path)
        return None

    def connect(self, name: str, consumers: list[Any]) -> None:
        """Build the channel of consumer set ``name``: the source's end first, then every consumer's."""
        spec = self._spec(name, len(consumers), consumers)
        key = f"{self.strategy}:{name}"
        refs = [self.source.actors[0].source_connect.remote(key, self.strategy, spec)]
        if self.strategy != "collective":  # the others need the source's end in place first
            handles.get(refs)
            refs = []
        refs += [c.weights_connect.remote(key, self.strategy, spec, i + 1) for i, c in enumerate(consumers)]
        handles.get(refs, timeout=300)
        self.sets[name] = list(consumers)

    def replace(self, name: str, index: int, consumer: Any) -> None:
        """Member ``index`` of set ``name`` was restarted: connect its replacement in its place."""
        if self.strategy == "collective":
            raise RuntimeError("a broadcast group's members are fixed; it cannot take a restarted replica")
        key = f"{self.strategy}:{name}"
        handles.get(consumer.weights_connect.remote(key, self.strategy, self._spec(name, 0), index + 1))
        self.sets[name][index] = consumer

    def snapshot(self, version: int) -> list[ray.ObjectRef]:
        """Keep a copy of the current weights as ``version`` on every source rank (async: publish later)."""
        return self.source.call("weights_snapshot", version)

    def publish_refs(self, version: int, names: tuple[str, ...] = ("policy",)) -> list[ray.ObjectRef]:
        names = tuple(n for n in names if self.sets.get(n))
        if not names:
            return []
        keys = [f"{self.strategy}:{n}" for n in names]
        sends = [a.weights_send.options(num_returns=3).remote(keys, version) for a in self.source.actors]
        payload, sent_bytes, send_s = sends[0]
        # collective consumers must run while the source sends; the others read what the send left
        arg = None if self.strategy == "collective" else payload
        refs = [send_s, sent_bytes] + [r for extra in sends[1:] for r in extra]
        for name, key in zip(names, keys, strict=True):
            refs += [c.weights_receive.remote(key, arg, version) for c in self.sets[name]]
        self._latest = (version, payload)
        self._sent_bytes = sent_bytes
        return refs

    def publish(self, version: int, names: tuple[str, ...] = ("policy",)) -> TransferStats:
        """Publish ``version`` to the sets ``names`` and wait until every consumer has loaded it."""
        t = time.perf_counter()
        refs = self.publish_refs(version, names)
        handles.get(refs)
        self.finished(version, time.perf_counter() - t)
        return self.stats

    def finished(self, version: int, seconds: float) -> None:
        """Record the stats of a publish whose refs have all completed."""
        sent = handles.get(self._sent_bytes) if self._sent_bytes is not None else 0
        self.stats = TransferStats(version, int(sent), seconds)

    def deliver(self, consumer: Any, version: int | None = None) -> ray.ObjectRef:
        """Bring ``consumer`` to the newest published version (or ``version`` straight from the source)."""
        if self._latest is None or version is not None or not self._channel_reaches(consumer):
            # a broadcast group has fixed members, the in-process hand-over only its own process: such a
            # newcomer gets the weights through the object store
            latest = self._latest[0] if self._latest else 0
            v = latest if version is None else version
            weights = self.source.call("state_dict")[0]  # every rank gathers; rank 0 returns the weights
            return consumer.weights_receive.remote(None, weights, v)
        v, payload = self._latest
        key = f"{self.strategy}:policy"
        handles.get(consumer.weights_connect.remote(key, self.strategy, self._spec("policy", 0), 1))
        return consumer.weights_receive.remote(key, payload, v)

    def _channel_reaches(self, consumer: Any) -> bool:
        """Whether ``consumer`` can join this strategy's channel after the fact."""
        if self.strategy == "in_process":
            return same_process(consumer, self.source.actors[0])
        return self.strategy != "collective"

    def close(self) -> None:
        if self.strategy == "shared_memory":  # the files outlive a killed source otherwise
            import glob

            for path in glob.glob(f"/dev/shm/{self._tag}-*"):
                try:
                    os.unlink(path)
                except OSError:
                    pass


def choose_strategy(configured: str, mode: str, source, consumers: list[Any], layout: Layout) -> str:
    """``auto``: in-process when every consumer shares the source's process, else shared memory when every
    consumer shares the source's node (and /dev/shm has room), else the object store (colocate) or a
    broadcast group (async)."""
    if configured != "auto":
        return configured
    if consumers and all(same_process(c, source.actors[0]) for c in consumers):
        return "in_process"
    from relax_core.weight_transfer.shared_memory import shared_memory_fits

    nodes = handles.get([c.node_id.remote() for c in [source.actors[0], *consumers]])
    if len(set(nodes)) == 1 and shared_memory_fits(layout, copies=2):
        return "shared_memory"
    return "collective" if mode == "async" else "object_store"


def same_process(a: Any, b: Any) -> bool:
    """Whether two role handles reach roles sharing one process: the roles of one Ray actor
    (:class:`~relax_core.ray_groups.RoleHandle`), or objects in this process (``cluster=in_process``)."""
    from relax_core.ray_groups import RoleHandle

    if isinstance(a, handles.InProcessActor) and isinstance(b, handles.InProcessActor):
        return True
    return isinstance(a, RoleHandle) and isinstance(b, RoleHandle) and (a.shared, a.i) == (b.shared, b.i)


__all__ = [
    "STRATEGIES",
    "WeightReceiver",
    "WeightSource",
    "WeightTransfer",
    "choose_strategy",
    "layout_of",
    "plan_buckets",
]
