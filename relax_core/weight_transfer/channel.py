"""What every weight-transfer strategy shares: the layout of a published state dict and the
:class:`Channel` each strategy implements (one end of its transport, living in a role process)."""

from __future__ import annotations

import abc
from typing import Any

import torch

# (name, shape, dtype) of every tensor the source publishes, in order
Layout = list[tuple[str, tuple[int, ...], str]]


def layout_of(state_dict: dict[str, torch.Tensor]) -> Layout:
    return [(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state_dict.items()]


def nbytes(layout: Layout) -> int:
    return sum(
        torch.Size(s).numel() * torch.empty((), dtype=getattr(torch, d)).element_size() for _, s, d in layout
    )


def plan_buckets(layout: Layout, bucket_mb: float) -> list[list[int]]:
    """Indices of ``layout`` grouped into consecutive same-dtype buckets of at most ``bucket_mb`` MiB
    (a single tensor larger than that gets a bucket of its own)."""
    limit = max(bucket_mb, 1e-6) * 2**20
    buckets: list[list[int]] = []
    size, dtype = 0.0, None
    for i, entry in enumerate(layout):
        size_i = nbytes([entry])
        if not buckets or entry[2] != dtype or size + size_i > limit:
            buckets.append([])
            size, dtype = 0.0, entry[2]
        buckets[-1].append(i)
        size += size_i
    return buckets


class Channel(abc.ABC):
    """One end of a strategy's transport, living in a role process (built from a picklable spec)."""

    @abc.abstractmethod
    def send(self, state_dict: dict[str, torch.Tensor], version: int) -> Any:
        """Source side: move ``state_dict`` into the channel; returns what consumers need to read it."""

    @abc.abstractmethod
    def receive(self, payload: Any) -> dict[str, torch.Tensor]:
        """Consumer side: the state dict that :meth:`send` put in (``payload`` is its return value)."""

    def close(self) -> None:
        """Release the channel's resources."""


class ObjectStoreChannel(Channel):
    """The state dict itself is the payload: Ray stores the source's return value once and every consumer
    process fetches it (no copy through the driver)."""

    def send(self, state_dict: dict[str, torch.Tensor], version: int) -> Any:
        return state_dict

    def receive(self, payload: Any) -> dict[str, torch.Tensor]:
        return payload
