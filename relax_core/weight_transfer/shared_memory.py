"""``shared_memory``: the Actor writes each version into files in ``/dev/shm`` that every consumer on its
node maps too; a consumer copies the tensors straight from the mapping into its model.

One file per dtype (a model has one or two), laid out in state-dict order; the files live as long as the
run and are rewritten in place, so a publish is one memory copy in and one copy out per consumer, with no
serialisation and nothing through the object store. Only for consumers on the Actor's node.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from relax_core.weight_transfer.channel import Channel, Layout, Transport, nbytes

if TYPE_CHECKING:
    from relax_core.weight_transfer import WeightTransfer

SHM_ROOT = Path("/dev/shm")


@dataclass
class SharedMemorySpec:
    prefix: str  # files are <prefix>-<dtype>.bin
    layout: Layout


def shared_memory_fits(layout: Layout, copies: int = 1) -> bool:
    """Whether /dev/shm exists and has room for ``copies`` of the weights (containers often cap it)."""
    if not SHM_ROOT.is_dir():
        return False
    return shutil.disk_usage(SHM_ROOT).free > nbytes(layout) * copies * 1.1


def remove_orphans() -> None:
    """Delete the weight files of runs whose driver is gone (killed, so it could not clean up): their names
    start with ``relax-<driver pid>-`` (:class:`relax_core.weight_transfer.WeightTransfer`)."""
    for path in SHM_ROOT.glob("relax-*-*"):
        pid = path.name.split("-")[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            path.unlink(missing_ok=True)


class SharedMemoryChannel(Channel):
    def __init__(self, spec: SharedMemorySpec, rank: int) -> None:
        self.rank = rank
        self.paths: list[str] = []
        self.views: dict[str, torch.Tensor] = {}
        for dtype_name in dict.fromkeys(d for _, _, d in spec.layout):
            entries = [e for e in spec.layout if e[2] == dtype_name]
            dtype = getattr(torch, dtype_name)
            numel = sum(torch.Size(s).numel() for _, s, _ in entries)
            path = f"{spec.prefix}-{dtype_name}.bin"
            if rank == 0:  # the source creates the file; consumers connect after it
                with open(path, "wb") as f:
                    f.truncate(numel * torch.empty((), dtype=dtype).element_size())
            flat = torch.from_file(path, shared=True, size=numel, dtype=dtype)
            offset = 0
            for name, shape, _ in entries:
                size = torch.Size(shape).numel()
                self.views[name] = flat[offset : offset + size].view(shape)
                offset += size
            self.paths.append(path)

    def send(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        with torch.no_grad():
            for name, view in self.views.items():
                view.copy_(state_dict[name])

    def receive(self, payload: object = None) -> dict[str, torch.Tensor]:
        return dict(self.views)

    def close(self) -> None:
        self.views.clear()
        if self.rank == 0:
            for path in self.paths:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass


class SharedMemoryTransport(Transport):
    name = "shared_memory"
    channel = SharedMemoryChannel

    def spec(self, transfer: WeightTransfer, set_name: str, consumers: list[Any]) -> SharedMemorySpec:
        remove_orphans()
        return SharedMemorySpec(f"{SHM_ROOT}/{transfer.tag}-{set_name}", transfer.layout)

    def close(self, transfer: WeightTransfer) -> None:
        for path in SHM_ROOT.glob(f"{transfer.tag}-*"):  # the files outlive a killed source
            path.unlink(missing_ok=True)
