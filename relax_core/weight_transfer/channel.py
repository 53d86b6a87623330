"""What every weight-transfer strategy shares: the layout of a published state dict, the :class:`Channel`
each strategy implements (one end of its transport, living in a role process) and the :class:`Transport`
that describes the strategy to the driver (how it sets up a consumer set, how consumers read it)."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from relax_core.weight_transfer import WeightTransfer

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

    def deliver(self, receiver: Any, payload: Any, version: int) -> None:
        """Consumer side: load what :meth:`send` put in into ``receiver`` (a :class:`WeightReceiver`)."""
        receiver.load_weights(self.receive(payload), version)

    def close(self) -> None:
        """Release the channel's resources."""


class Transport:
    """A weight-transfer strategy as the driver sees it: the spec its channel ends are built from, and how
    consumers read a publish. One instance per strategy, in :data:`relax_core.weight_transfer.base.TRANSPORTS`.
    """

    name: ClassVar[str]
    channel: ClassVar[type[Channel]]
    # consumers read the source's return value (an object-store reference, a folder) instead of a channel end
    reads_payload: ClassVar[bool] = False
    # the members are fixed when the channel is built and receive while the source sends (a broadcast
    # group): a restarted or late consumer cannot join, and every end connects at once
    fixed_members: ClassVar[bool] = False
    # whether a user can name it as ``weight_transfer=<name>`` (in_process is only ever picked by auto)
    user_option: ClassVar[bool] = True

    def spec(self, transfer: WeightTransfer, set_name: str, consumers: list[Any]) -> Any:
        """The picklable description both ends of consumer set ``set_name``'s channel are built from."""
        return None

    def open(self, spec: Any, rank: int) -> Channel:
        """This process's end: rank 0 sends, ranks > 0 receive."""
        return self.channel(spec, rank)

    def receive_argument(self, payload: Any, send_done: Any) -> Any:
        """What a consumer's ``weights_receive`` is handed: the payload, or the send's completion (so it
        reads only after the source wrote), or nothing when it must receive while the source sends."""
        if self.fixed_members:
            return None
        return payload if self.reads_payload else send_done

    def close(self, transfer: WeightTransfer) -> None:
        """Driver-side clean-up when the run ends (what a killed source could not remove)."""


class ObjectStoreChannel(Channel):
    """The state dict itself is the payload: Ray stores the source's return value once and every consumer
    process fetches it (no copy through the driver)."""

    def __init__(self, spec: Any = None, rank: int = 0) -> None:
        pass

    def send(self, state_dict: dict[str, torch.Tensor], version: int) -> Any:
        return state_dict

    def receive(self, payload: Any) -> dict[str, torch.Tensor]:
        return payload


class ObjectStoreTransport(Transport):
    name = "object_store"
    channel = ObjectStoreChannel
    reads_payload = True
