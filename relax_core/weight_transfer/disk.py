"""``disk``: each version becomes an HF folder (safetensors + the base model's config and tokenizer) under
the run dir, for engines that can only reload from files (external SGLang-compatible servers). The folder
of the newest ``keep`` versions stay; older ones are deleted as new ones arrive."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from relax_core.weight_transfer.channel import Channel, Transport

if TYPE_CHECKING:
    from relax_core.weight_transfer import WeightTransfer


@dataclass
class DiskSpec:
    root: str
    base_model_path: str | None
    keep: int = 2


class DiskChannel(Channel):
    def __init__(self, spec: DiskSpec, rank: int = 0) -> None:
        self.spec = spec
        self.folders: list[Path] = []

    def send(self, state_dict: dict[str, torch.Tensor], version: int) -> str:
        from relax_core.engines.client import save_weights_folder

        folder = save_weights_folder(
            state_dict, self.spec.base_model_path, Path(self.spec.root) / f"v{version}"
        )
        self.folders = [f for f in self.folders if f != folder] + [folder]
        while len(self.folders) > self.spec.keep:
            shutil.rmtree(self.folders.pop(0), ignore_errors=True)
        return str(folder.resolve())

    def receive(self, payload: str) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for f in sorted(Path(payload).glob("*.safetensors")):
            state.update(load_file(str(f)))
        return state

    def close(self) -> None:
        for folder in self.folders:
            shutil.rmtree(folder, ignore_errors=True)
        self.folders.clear()


class DiskTransport(Transport):
    name = "disk"
    channel = DiskChannel
    reads_payload = True

    def spec(self, transfer: WeightTransfer, set_name: str, consumers: list[Any]) -> DiskSpec:
        return DiskSpec(f"{transfer.run_dir}/rollout_weights/{set_name}", transfer.model_path)
