"""``collective``: the Actor broadcasts each version over a torch.distributed group (NCCL when every member
has a GPU of its own, else gloo: :func:`collective_backend`).

Rank 0 (the Actor) flattens the state dict into buckets of about ``weight_transfer.bucket_mb`` MiB (one
dtype per bucket, parameters in state-dict order) and broadcasts them one after the other; every consumer
knows the layout from the start, so a bucket is one contiguous ``broadcast`` and nothing else is sent.
The group is a standalone ``ProcessGroupGloo``/``ProcessGroupNCCL`` on its own TCPStore, so it does not
touch the default process group a training backend may use. Its members are fixed when it is built.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from relax_core.weight_transfer.channel import Channel, Layout, Transport, plan_buckets

if TYPE_CHECKING:
    from relax_core.weight_transfer import WeightTransfer

log = logging.getLogger("relax")


def collective_backend(members: Sequence[tuple[str, Sequence[str]]]) -> str:
    """``nccl`` when every member has a GPU of its own, else ``gloo``.

    ``members``: each member's (node id, GPU ids Ray gave it), the source first. A member uses the first of
    its GPUs (``cuda:0`` once Ray narrowed ``CUDA_VISIBLE_DEVICES``); NCCL cannot put two ranks on one
    GPU, nor a rank on none, so a GPU-less member or two sharing a GPU (fractional colocation) need gloo.
    """
    used: set[tuple[str, str]] = set()
    for node, gpus in members:
        if not gpus or (node, gpus[0]) in used:
            return "gloo"
        used.add((node, gpus[0]))
    return "nccl"


@dataclass
class SyncSpec:
    """What every member needs to join one broadcast group."""

    name: str
    host: str
    port: int
    world_size: int
    layout: Layout
    bucket_mb: float = 64.0
    backend: str = "gloo"
    timeout_s: float = 300.0


class BroadcastPeerLost(RuntimeError):
    """A member of a broadcast group died under a broadcast: the group is broken for every member, as if
    the member's actor error had reached them (the HealthManager recovers)."""


def gloo_group(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A gloo group whose members advertise the interface holding their Ray node IP where the hostname
    resolves elsewhere (often loopback, which members on other nodes cannot reach)."""
    from relax_core.runtime.placement import gloo_interface

    interface = None
    try:
        import ray

        if ray.is_initialized():
            interface = gloo_interface(ray.util.get_node_ip_address())
    except ImportError:  # cluster=in_process without Ray: one process, loopback is right
        pass
    if interface is None:
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(interface=interface)]
    return dist.ProcessGroupGloo(store, rank, size, options)


class WeightSyncGroup(Channel):
    """One member of a broadcast group; rank 0 sends, every other rank receives."""

    def __init__(self, spec: SyncSpec, rank: int) -> None:
        self.spec, self.rank = spec, rank
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        store = dist.TCPStore(spec.host, spec.port, spec.world_size, is_master=rank == 0, timeout=timeout)
        store = dist.PrefixStore(f"relax_ws/{spec.name}", store)
        self._store = store
        if spec.backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.pg = dist.ProcessGroupNCCL(store, rank, spec.world_size)
        else:
            self.device = torch.device("cpu")
            self.pg = gloo_group(store, rank, spec.world_size, timeout)
        self.buckets = plan_buckets(spec.layout, spec.bucket_mb)
        self.bytes_sent = 0

    def _broadcast(self, flat: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        try:
            self.pg.broadcast([flat], opts).wait()
        except RuntimeError as err:  # gloo/NCCL: a member's process (or node) is gone
            raise BroadcastPeerLost(f"weight broadcast group {self.spec.name}: {err}") from err

    def send(self, state_dict: dict[str, torch.Tensor], version: int = 0) -> None:
        """Rank 0: broadcast ``state_dict`` bucket by bucket."""
        assert self.rank == 0, "only rank 0 sends"
        for bucket in self.buckets:
            names = [self.spec.layout[i][0] for i in bucket]
            flat = torch.cat([state_dict[n].detach().reshape(-1) for n in names]).to(self.device)
            self._broadcast(flat)
            self.bytes_sent += flat.numel() * flat.element_size()

    def receive(self, payload: object = None) -> dict[str, torch.Tensor]:
        """Ranks > 0: the next broadcast state dict (on CPU for gloo, on the GPU for NCCL)."""
        out: dict[str, torch.Tensor] = {}
        for bucket in self.buckets:
            entries = [self.spec.layout[i] for i in bucket]
            dtype = getattr(torch, entries[0][2])
            sizes = [torch.Size(shape).numel() for _, shape, _ in entries]
            flat = torch.empty(sum(sizes), dtype=dtype, device=self.device)
            self._broadcast(flat)
            for (name, shape, _), part in zip(entries, flat.split(sizes), strict=True):
                out[name] = part.view(shape)
        return out

    def close(self) -> None:
        self.pg = None
        self._store = None


class CollectiveTransport(Transport):
    name = "collective"
    channel = WeightSyncGroup
    fixed_members = True

    def spec(self, transfer: WeightTransfer, set_name: str, consumers: list[Any]) -> SyncSpec:
        from relax_core.runtime import handles

        source = transfer.source.actors[0]
        host, port = handles.get(source.free_address.remote())
        # from what the members were given, not from the driver's devices
        reports = handles.get([m.device_report.remote() for m in [source, *consumers]])
        backend = collective_backend(reports)
        log.info("weight broadcast group %s: %s over %s", set_name, backend, reports)
        return SyncSpec(
            set_name, host, port, len(consumers) + 1, transfer.layout, transfer.bucket_mb, backend
        )
