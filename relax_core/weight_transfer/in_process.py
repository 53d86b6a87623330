"""``in_process``: the consumer lives in the source's process (colocate's Actor and rollout engine sharing
one process, :class:`relax_core.runtime.groups.SharedProcesses`). The source leaves its state dict in this
process and the consumer loads from those very tensors: nothing is serialised, mapped or sent.

``weight_transfer=auto`` picks it by itself when every consumer shares the source's process; it is not a
user option because it cannot work otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from relax_core.weight_transfer.channel import Channel, Transport

if TYPE_CHECKING:
    from relax_core.weight_transfer import WeightTransfer

# channel key -> the newest state dict the source left for consumers in this process
_LEFT: dict[str, dict[str, torch.Tensor]] = {}


@dataclass
class InProcessSpec:
    key: str


class InProcessChannel(Channel):
    def __init__(self, spec: InProcessSpec, rank: int) -> None:
        self.key, self.rank = spec.key, rank

    def send(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        _LEFT[self.key] = state_dict

    def receive(self, payload: object = None) -> dict[str, torch.Tensor]:
        return _LEFT[self.key]

    def close(self) -> None:
        if self.rank == 0:
            _LEFT.pop(self.key, None)


class InProcessTransport(Transport):
    name = "in_process"
    channel = InProcessChannel
    user_option = False

    def spec(self, transfer: WeightTransfer, set_name: str, consumers: list[Any]) -> InProcessSpec:
        return InProcessSpec(f"{transfer.tag}-{set_name}")
