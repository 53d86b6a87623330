"""WeightSync: the Actor broadcasts versioned policy weights to its followers over a torch.distributed group.

Followers are the rollout engines, ActorFwd and (every ``mode.ref_update_interval`` steps) the Reference.
Rank 0 (the Actor) flattens the state dict into buckets of about ``mode.weight_sync_bucket_mb`` MiB (one
dtype per bucket, parameters in state-dict order) and broadcasts them one after the other; every follower
knows the layout from the start, so a bucket is one contiguous ``broadcast`` and nothing else is sent.
Gloo on CPU, NCCL on GPU. The group is a standalone ``ProcessGroupGloo``/``ProcessGroupNCCL`` on its own
TCPStore, so it does not touch the default process group a training backend may use.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

# (name, shape, dtype) of every tensor the sender publishes, in order
Layout = list[tuple[str, tuple[int, ...], str]]


def layout_of(state_dict: dict[str, torch.Tensor]) -> Layout:
    return [(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state_dict.items()]


def plan_buckets(layout: Layout, bucket_mb: float) -> list[list[int]]:
    """Indices of ``layout`` grouped into consecutive same-dtype buckets of at most ``bucket_mb`` MiB
    (a single tensor larger than that gets a bucket of its own)."""
    limit = max(bucket_mb, 1e-6) * 2**20
    buckets: list[list[int]] = []
    size, dtype = 0.0, None
    for i, (_, shape, dt) in enumerate(layout):
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=getattr(torch, dt)).element_size()
        if not buckets or dt != dtype or size + nbytes > limit:
            buckets.append([])
            size, dtype = 0.0, dt
        buckets[-1].append(i)
        size += nbytes
    return buckets


def free_port() -> tuple[str, int]:
    """An address and a currently free TCP port of this node, for the group's rendezvous."""
    import ray

    host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return host, s.getsockname()[1]


@dataclass
class SyncSpec:
    """What every member needs to join one weight-sync group."""

    name: str
    host: str
    port: int
    world_size: int
    layout: Layout
    bucket_mb: float = 64.0
    backend: str = "gloo"
    timeout_s: float = 300.0


class WeightSyncGroup:
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
            self.pg = dist.ProcessGroupGloo(store, rank, spec.world_size, timeout)
        self.buckets = plan_buckets(spec.layout, spec.bucket_mb)
        self.bytes_sent = 0

    def _broadcast(self, flat: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([flat], opts).wait()

    def send(self, state_dict: dict[str, torch.Tensor]) -> int:
        """Rank 0: broadcast ``state_dict`` bucket by bucket; returns the bytes sent."""
        assert self.rank == 0, "only rank 0 sends"
        sent = 0
        for bucket in self.buckets:
            names = [self.spec.layout[i][0] for i in bucket]
            flat = torch.cat([state_dict[n].detach().reshape(-1) for n in names]).to(self.device)
            self._broadcast(flat)
            sent += flat.numel() * flat.element_size()
        self.bytes_sent += sent
        return sent

    def receive(self) -> dict[str, torch.Tensor]:
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
