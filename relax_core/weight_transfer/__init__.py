"""Driver side of weight transfer: :class:`WeightTransfer` publishes versions of the source's weights to
named consumer sets through one strategy (see :mod:`relax_core.weight_transfer.base`)."""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import TYPE_CHECKING, Any

from relax_core.runtime import handles
from relax_core.weight_transfer.base import TRANSPORTS, TransferStats, WeightReceiver, WeightSource, transport
from relax_core.weight_transfer.channel import Layout, layout_of, plan_buckets

if TYPE_CHECKING:
    import ray

    from relax_core.config.schema import WeightTransferConfig

log = logging.getLogger("relax")

# what ``weight_transfer=`` accepts
STRATEGIES = ["auto", *(name for name, t in TRANSPORTS.items() if t.user_option)]


class WeightTransfer:
    """Publishes policy versions from ``source`` (a RoleGroup of :class:`WeightSource` ranks; rank 0 holds
    the weights) to consumer sets (lists of :class:`WeightReceiver` actor handles).

    ``strategy`` is the configured one; ``auto`` picks one per consumer (:func:`consumer_strategies`), so a
    set may mix channels (shared memory to the engines on the Actor's node, the object store or a broadcast
    group to the others). ``publish_refs`` starts a publish and returns the refs that finish when every
    consumer loaded it, so async mode can overlap it with training; ``publish`` waits. ``deliver`` brings
    one consumer outside the sets (an engine added by scale-out) to the newest version.
    """

    def __init__(
        self,
        strategy: str,
        source,
        cfg: WeightTransferConfig,
        run_dir: str,
        model_path: str,
        mode: str = "colocate",
    ) -> None:
        self.strategy = strategy
        self.mode = mode
        self.source = source
        self.bucket_mb = cfg.bucket_mb
        self.run_dir = run_dir
        self.model_path = model_path
        self.sets: dict[str, list[Any]] = {}
        self.routes: dict[str, list[str]] = {}  # set name -> each consumer's strategy
        self.stats = TransferStats()
        # (version, payload ref per channel key, send-done ref) of the newest publish
        self._latest: tuple[int, dict[str, Any], Any] | None = None
        # consumer sets served by one channel that members join and leave (external engines: disk), by name
        self.open_channels: dict[str, str] = {}
        self._sent_bytes: ray.ObjectRef | None = None  # what the newest publish moved (the source says)
        # names this run's channel resources (shared-memory files start with it: a dead driver's are found)
        self.tag = f"relax-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._layout: Layout | None = None
        self._logged: set[int] = set()  # consumers whose route was logged

    @property
    def layout(self) -> Layout:
        if self._layout is None:
            # gathering the weights is collective on sharded (FSDP / megatron) Actors: every rank takes part
            self._layout = handles.get(self.source.call("weights_layout"))[0]
        return self._layout

    def describe(self) -> str:
        """The strategies in use, e.g. ``shared_memory`` or ``auto (object_store x2, shared_memory x1)``."""
        used = [s for route in self.routes.values() for s in route]
        kinds = sorted(set(used))
        if len(kinds) == 1:
            return kinds[0]
        return f"{self.strategy} ({', '.join(f'{k} x{used.count(k)}' for k in kinds)})"

    def fixed_member(self, name: str, index: int) -> bool:
        """Whether member ``index`` of set ``name`` sits in a channel whose members are fixed (a broadcast
        group), so a restarted replica cannot take its place."""
        return TRANSPORTS[self.routes[name][index]].fixed_members

    def _log_routes(self, consumers: dict[str, Any], routes: list[str], nodes: list[str]) -> None:
        """Log, once per consumer, the channel that reaches it (``consumers``: label -> handle)."""
        for (label, consumer), route, node in zip(consumers.items(), routes, nodes, strict=True):
            if id(consumer) not in self._logged:
                self._logged.add(id(consumer))
                log.info("weight transfer: %s %s <- %s", label, node, route)

    def connect(self, name: str, consumers: list[Any]) -> None:
        """Build the channels of consumer set ``name``: per strategy, the source's end first, then every
        consumer's."""
        routes, nodes = consumer_strategies(
            self.strategy, self.mode, self.source, consumers, self.layout, strict=True
        )
        self._log_routes({f"{name} consumer {i}": c for i, c in enumerate(consumers)}, routes, nodes)
        for strategy in sorted(set(routes), key=list(TRANSPORTS).index):
            members = [c for i, c in enumerate(consumers) if routes[i] == strategy]
            spec = TRANSPORTS[strategy].spec(self, name, members)
            key = f"{strategy}:{name}"
            refs = [self.source.actors[0].source_connect.remote(key, strategy, spec)]
            if not TRANSPORTS[strategy].fixed_members:  # the others need the source's end in place first
                handles.get(refs)
                refs = []
            # a consumer's rank counts within its channel (a broadcast group's ranks are 1..members)
            refs += [c.weights_connect.remote(key, strategy, spec, r + 1) for r, c in enumerate(members)]
            handles.get(refs, timeout=300)
        self.sets[name] = list(consumers)
        self.routes[name] = routes

    def replace(self, name: str, index: int, consumer: Any) -> None:
        """Member ``index`` of set ``name`` was restarted (maybe on another node): connect its replacement
        in its place, through the channel that reaches where it now runs."""
        if TRANSPORTS[self.routes[name][index]].fixed_members:
            raise RuntimeError("a broadcast group's members are fixed; it cannot take a restarted replica")
        (route,), nodes = consumer_strategies(
            self.strategy, self.mode, self.source, [consumer], self.layout, strict=True, cross="object_store"
        )
        key = f"{route}:{name}"
        spec = transport(route).spec(self, name, [consumer])
        if route not in self.routes[name]:  # the first of the set on this channel: open the source's end
            handles.get(self.source.actors[0].source_connect.remote(key, route, spec))
        self._logged.discard(id(consumer))
        self._log_routes({f"{name} consumer {index}": consumer}, [route], nodes)
        handles.get(consumer.weights_connect.remote(key, route, spec, index + 1))
        self.sets[name][index] = consumer
        self.routes[name][index] = route

    def snapshot(self, version: int) -> list[ray.ObjectRef]:
        """Keep a copy of the current weights as ``version`` on every source rank (async: publish later)."""
        return self.source.call("weights_snapshot", version)

    def open_channel(self, name: str, strategy: str) -> None:
        """Open the source's end of a channel for consumer set ``name``, whose members (engine servers that
        join and leave by URL) are reached only through :meth:`deliver`. A publish that names ``name``
        sends into it even while no member is there, so a joining one finds that version."""
        key = f"{strategy}:{name}"
        spec = transport(strategy).spec(self, name, [])
        handles.get(self.source.actors[0].source_connect.remote(key, strategy, spec))
        self.open_channels[name] = key

    def reaches(self, consumer: Any) -> bool:
        """Whether a late ``consumer`` can read the channels of the ``policy`` set: one of its kind (shared
        memory on the Actor's node, the object store) is among them and takes members that come later."""
        (route,), _ = consumer_strategies(
            self.strategy, self.mode, self.source, [consumer], self.layout, strict=False, cross="object_store"
        )
        return not transport(route).fixed_members and route in self.routes.get("policy", [])

    def published_into(self, name: str) -> bool:
        """Whether the newest publish sent into the :meth:`open_channel` of set ``name``."""
        return self._latest is not None and self.open_channels.get(name) in self._latest[1]

    def publish_refs(self, version: int, names: tuple[str, ...] = ("policy",)) -> list[ray.ObjectRef]:
        """Start publishing ``version`` into the channels of the sets ``names``; returns the refs that finish
        once the source sent it and every member of those sets loaded it (the first is the send's seconds)."""
        keys = {f"{s}:{n}" for n in names for s in self.routes.get(n, [])}
        keys |= {self.open_channels[n] for n in names if n in self.open_channels}
        if not keys:
            return []
        keys = sorted(keys, key=lambda k: list(TRANSPORTS).index(k.split(":", 1)[0]))
        sends = [
            a.weights_send.options(num_returns=2 + len(keys)).remote(keys, version)
            for a in self.source.actors
        ]
        send_s, sent_bytes, *payload_refs = sends[0]
        payloads = dict(zip(keys, payload_refs, strict=True))
        refs = [send_s, sent_bytes] + [r for extra in sends[1:] for r in extra[:2]]
        for name in names:
            for consumer, route in zip(self.sets.get(name, []), self.routes.get(name, []), strict=True):
                key = f"{route}:{name}"
                arg = TRANSPORTS[route].receive_argument(payloads[key], send_s)
                refs.append(consumer.weights_receive.remote(key, arg, version))
        self._latest = (version, payloads, send_s)
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

    def deliver(
        self, consumer: Any, version: int | None = None, name: str = "policy"
    ) -> ray.ObjectRef | None:
        """Bring ``consumer`` to the newest published version (or ``version`` straight from the source).

        A member of an :meth:`open_channel` set ``name`` reads that channel's newest version; None when the
        newest publish did not send into it (the caller waits for a publish that names ``name``)."""
        if name in self.open_channels:
            key = self.open_channels[name]
            if not self.published_into(name):
                return None
            return self._read_latest(consumer, key, name)
        (route,), nodes = consumer_strategies(
            self.strategy, self.mode, self.source, [consumer], self.layout, strict=False, cross="object_store"
        )
        key = f"{route}:policy"
        late = transport(route)
        if self._latest is None or version is not None or key not in self._latest[1] or late.fixed_members:
            # no channel of its kind was published into (or a broadcast group, whose members are fixed):
            # the newcomer gets the weights through the object store
            if self.mode == "async" and version is None:  # the Actor trains on: its weights are newer
                raise RuntimeError(
                    f"a joining engine {nodes[0]} reads no channel of the last publish: in mode=async it "
                    "must run on the Actor's node, or the run needs weight_transfer=object_store"
                )
            route, latest = "object_store", self._latest[0] if self._latest else 0
            self._log_routes({"a late consumer": consumer}, [f"{route} (from the source)"], nodes)
            v = latest if version is None else version
            weights = self.source.call("publish_weights")[0]  # every rank gathers; rank 0 returns them
            return consumer.weights_receive.remote(None, weights, v)
        self._log_routes({"a late consumer": consumer}, [route], nodes)
        return self._read_latest(consumer, key, "policy")

    def _read_latest(self, consumer: Any, key: str, name: str) -> ray.ObjectRef:
        """``consumer`` opens its end of channel ``key`` (of set ``name``) and reads the newest publish."""
        route = transport(key.split(":", 1)[0])
        handles.get(consumer.weights_connect.remote(key, route.name, route.spec(self, name, [consumer]), 1))
        v, payloads, sent = self._latest
        return consumer.weights_receive.remote(key, route.receive_argument(payloads[key], sent), v)

    def close(self) -> None:
        used = {route for routes in self.routes.values() for route in routes}
        used |= {key.split(":", 1)[0] for key in self.open_channels.values()}
        for name in used:
            TRANSPORTS[name].close(self)


def consumer_strategies(
    configured: str,
    mode: str,
    source,
    consumers: list[Any],
    layout: Layout,
    strict: bool = True,
    cross: str | None = None,
) -> tuple[list[str], list[str]]:
    """(each consumer's strategy, where each consumer runs, for the log). ``auto``: in-process for a consumer in the
    source's process, shared memory for one on the source's node (when the source's /dev/shm has room),
    else the object store (colocate; ``cross`` overrides it) or a broadcast group (async). A forced
    ``shared_memory`` with a consumer on another node is a :class:`RelaxUserError` (``strict``), else that
    consumer goes through the object store."""
    from relax_core.errors import RelaxUserError

    source0 = source.actors[0]
    local = [same_process(c, source0) for c in consumers]
    if all(local):  # cluster=in_process, or colocate's fused Actor + engine: no Ray query needed
        route = "in_process" if configured == "auto" else configured
        return [route] * len(consumers), ["in the Actor's process"] * len(consumers)
    where = handles.get([c.node_address.remote() for c in [source0, *consumers]])
    (src_node, src_ip), placed = where[0], where[1:]
    nodes = [f"on node {ip} (Actor on {src_ip})" for _, ip in placed]  # for the log
    if configured != "auto":
        # the in-process hand-over reaches only the source's own process
        routes = [configured if here or configured != "in_process" else "object_store" for here in local]
        if configured == "shared_memory":
            away = [i for i, (node, _) in enumerate(placed) if node != src_node]
            if away and strict:
                i = away[0]
                raise RelaxUserError(
                    f"weight_transfer=shared_memory: consumer {i} runs on node {placed[i][1]}, the Actor on "
                    f"{src_ip}, and /dev/shm does not cross nodes: set weight_transfer=auto (or object_store)"
                )
            routes = ["object_store" if i in away else r for i, r in enumerate(routes)]
        return routes, nodes
    remote = cross or ("collective" if mode == "async" else "object_store")
    shm = any(node == src_node for node, _ in placed) and handles.get(
        source0.shared_memory_room.remote(layout, 2)
    )
    routes = [
        "in_process" if here else "shared_memory" if shm and node == src_node else remote
        for here, (node, _) in zip(local, placed, strict=True)
    ]
    return routes, nodes


def same_process(a: Any, b: Any) -> bool:
    """Whether two role handles reach roles sharing one process: the roles of one Ray actor
    (:class:`~relax_core.runtime.groups.RoleHandle`), or objects in this process (``cluster=in_process``)."""
    from relax_core.runtime.groups import RoleHandle

    if isinstance(a, handles.InProcessActor) and isinstance(b, handles.InProcessActor):
        return True
    return isinstance(a, RoleHandle) and isinstance(b, RoleHandle) and (a.shared, a.i) == (b.shared, b.i)


__all__ = [
    "STRATEGIES",
    "WeightReceiver",
    "WeightSource",
    "WeightTransfer",
    "consumer_strategies",
    "layout_of",
    "plan_buckets",
]
