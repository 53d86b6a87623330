"""Weight transfer: how policy version ``v`` travels from the Actor to every role that uses it.

Consumers — rollout engines (launch and elastic), ActorFwd, Reference — mix in :class:`WeightReceiver`
and implement ``load_weights(state_dict, version)``; the Actor mixes in :class:`WeightSource`. A
:class:`WeightTransfer` strategy runs in the driver and decides how the bytes travel, so a consumer never
knows which one is in use:

==============  ====================================  ============================================
strategy        consumers                             cost per version
==============  ====================================  ============================================
shared_memory   on the Actor's node                   one copy into /dev/shm, one copy out each
object_store    anywhere (Ray object store)           one ``ray.put`` + one fetch per node
collective      a fixed set anywhere (gloo / NCCL)    one bucketed broadcast
disk            engines that only reload from files   an HF folder per version (the last 2 kept)
in_process      in the Actor's own process            none: the consumer loads the source's tensors
==============  ====================================  ============================================

``weight_transfer=auto`` picks per consumer: ``in_process`` for one in the Actor's process (colocate's
fused Actor + engine), shared memory for one on the Actor's node, else the object store (colocate:
consumers come and go with elastic scaling) or the collective (async: a fixed set); one publish feeds
every channel its set uses. A forced ``shared_memory`` with a consumer on another node fails at launch.
Every publish reports its bytes and seconds (``weights/bytes``, ``time/weight_sync_s``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from relax_core.weight_transfer.channel import (
    Channel,
    Layout,
    ObjectStoreTransport,
    Transport,
    layout_of,
    nbytes,
)
from relax_core.weight_transfer.collective import CollectiveTransport
from relax_core.weight_transfer.disk import DiskTransport
from relax_core.weight_transfer.in_process import InProcessTransport
from relax_core.weight_transfer.shared_memory import SharedMemoryTransport

# every strategy by name, in the order the source sends into a publish's channels
TRANSPORTS: dict[str, Transport] = {
    t.name: t
    for t in (
        InProcessTransport(),
        SharedMemoryTransport(),
        CollectiveTransport(),
        DiskTransport(),
        ObjectStoreTransport(),
    )
}


def transport(strategy: str) -> Transport:
    if strategy not in TRANSPORTS:
        raise ValueError(f"no weight-transfer strategy {strategy!r}; known: {sorted(TRANSPORTS)}")
    return TRANSPORTS[strategy]


class _WeightEndpoint:
    """What both ends keep: their open channels by key (``<strategy>:<consumer set>``)."""

    def _weight_channels(self) -> dict[str, Channel]:
        if not hasattr(self, "_channels"):
            self._channels: dict[str, Channel] = {}
        return self._channels

    def node_address(self) -> tuple[str, str]:
        """(node id, node IP) of this process: which consumers share the source's node."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def shared_memory_room(self, layout: Layout, copies: int) -> bool:
        """Whether this node's /dev/shm holds ``copies`` of the weights (asked of the source, whose node's
        /dev/shm the files would live in)."""
        from relax_core.weight_transfer.shared_memory import shared_memory_fits

        return shared_memory_fits(layout, copies)

    def device_report(self) -> tuple[str, list[str]]:
        """(node id, GPU ids Ray gave this process): what picks a broadcast group's backend."""
        import ray

        context = ray.get_runtime_context()
        return context.get_node_id(), context.get_accelerator_ids().get("GPU", [])


class WeightSource(_WeightEndpoint):
    """Mixin of the role that owns the trained weights (the Actor); needs ``self.backend``.

    ``weights_snapshot(v)`` keeps a copy of version ``v`` so that async mode can publish it while the next
    step already trains; without a snapshot the current weights are sent.
    """

    def _published(self) -> dict[str, torch.Tensor]:
        """What a version carries, built on every rank (collective for sharded backends): the backend's state
        dict (the Actor's: its ``publish_weights``, with LoRA adapter sync an adapter payload)."""
        return self.backend.state_dict()

    def publish_weights(self) -> dict[str, torch.Tensor]:
        """A version for a consumer that joins late (``WeightTransfer.deliver``)."""
        return self._published()

    def weights_layout(self) -> Layout:
        return layout_of(self._published())

    def free_address(self) -> tuple[str, int]:
        """This node's address and a free port: the rendezvous of a broadcast group the source leads."""
        import ray

        from relax_models.ports import free_port

        return ray.util.get_node_ip_address(), free_port()

    def source_connect(self, key: str, strategy: str, spec: Any) -> None:
        self._weight_channels()[key] = transport(strategy).open(spec, 0)

    def weights_snapshot(self, version: int) -> None:
        if not hasattr(self, "_snapshots"):
            self._snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self._snapshots[version] = self._published()

    def weights_send(self, keys: list[str], version: int) -> tuple[Any, ...]:
        """Send version ``version`` (its snapshot, else the current weights) into the channels ``keys``;
        returns (seconds, bytes, then each channel's payload in the order of ``keys``)."""
        t = time.perf_counter()
        snapshots = getattr(self, "_snapshots", {})
        state = snapshots.pop(version, None) or self._published()
        for older in [v for v in snapshots if v < version]:  # never sent (a recovery skipped them)
            del snapshots[older]
        payloads = [None] * len(keys)
        if getattr(self, "rank", 0) == 0:  # model-parallel ranks only take part in gathering the weights
            payloads = [self._weight_channels()[key].send(state, version) for key in keys]
        return time.perf_counter() - t, nbytes(layout_of(state)) * len(keys), *payloads


class WeightReceiver(_WeightEndpoint):
    """Mixin of every role that uses the policy's weights: it implements :meth:`load_weights`."""

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        raise NotImplementedError

    def load_weights_folder(self, folder: str, version: int) -> None:
        """Version ``version`` from an HF folder (the ``disk`` channel); a role whose engine server reloads
        folders by path overrides it."""
        from relax_core.weight_transfer.disk import read_weights_folder

        self.load_weights(read_weights_folder(folder), version)

    def weights_connect(self, key: str, strategy: str, spec: Any, rank: int) -> None:
        channels = self._weight_channels()
        if key not in channels or transport(strategy).fixed_members:  # a rebuilt group: a new end
            channels[key] = transport(strategy).open(spec, rank)

    def weights_receive(self, key: str | None, payload: Any, version: int) -> float:
        """Read version ``version`` from channel ``key`` (None: ``payload`` is the state dict itself) and
        load it; returns the seconds it took."""
        t = time.perf_counter()
        if key is None:
            self.load_weights(payload, version)
        else:
            self._weight_channels()[key].deliver(self, payload, version)
        return time.perf_counter() - t


@dataclass
class TransferStats:
    version: int = -1
    bytes: int = 0
    seconds: float = 0.0

    def metrics(self) -> dict[str, float]:
        return {"time/weight_sync_s": self.seconds, "weights/bytes": float(self.bytes)}
