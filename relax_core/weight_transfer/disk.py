"""``disk``: each version becomes an HF folder (safetensors + the base model's config and tokenizer) under
the run dir, for engines that can only reload from files (external SGLang-compatible servers). The folders
of the newest ``keep`` versions stay; older ones are deleted as new ones arrive. The source (the Actor's
rank 0) writes it, from the version's snapshot in mode=async; consumers are handed the folder's path.

The folder format is defined here once: :func:`save_weights_folder` writes it (this channel and the folder
push into an engine server, ``server_push``), :func:`read_weights_folder` reads it back."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from relax_core.weight_transfer.channel import Channel, Transport
from relax_models.lora import merged_payload

if TYPE_CHECKING:
    from relax_core.weight_transfer import WeightTransfer


@dataclass
class DiskSpec:
    root: str
    base_model_path: str | None
    keep: int = 2


def save_weights_folder(state_dict: dict[str, torch.Tensor], base_model_path: str | None, out: Path) -> Path:
    """Write ``state_dict`` as ``model.safetensors`` plus the base folder's config/tokenizer files, so a
    server that reloads a whole folder (SGLang) finds a complete checkpoint."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    if base_model_path:
        for f in Path(base_model_path).iterdir():
            if (
                f.is_file()
                and not f.name.endswith((".safetensors", ".bin"))
                and f.name != "model.safetensors.index.json"
            ):
                shutil.copy2(f, out / f.name)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    # tied embeddings share storage; safetensors refuses shared tensors
    seen: dict[int, str] = {}
    for k in list(tensors):
        ptr = tensors[k].data_ptr()
        if ptr in seen:
            tensors[k] = tensors[k].clone()
        seen[ptr] = k
    save_file(tensors, str(out / "model.safetensors"))
    return out


def read_weights_folder(folder: str) -> dict[str, torch.Tensor]:
    """The state dict in the ``*.safetensors`` files of an HF folder."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


class DiskChannel(Channel):
    def __init__(self, spec: DiskSpec, rank: int = 0) -> None:
        self.spec = spec
        self.folders: list[Path] = []

    def send(self, state_dict: dict[str, torch.Tensor], version: int) -> str:
        # an HF folder holds the merged model: servers that reload folders know no adapter payload
        folder = save_weights_folder(
            merged_payload(state_dict), self.spec.base_model_path, Path(self.spec.root) / f"v{version}"
        )
        self.folders = [f for f in self.folders if f != folder] + [folder]
        while len(self.folders) > self.spec.keep:
            shutil.rmtree(self.folders.pop(0), ignore_errors=True)
        return str(folder.resolve())

    def receive(self, payload: str) -> dict[str, torch.Tensor]:
        return read_weights_folder(payload)

    def deliver(self, receiver: Any, payload: str, version: int) -> None:
        """The consumer gets the folder's path: an engine server that reloads folders reads it itself."""
        receiver.load_weights_folder(payload, version)

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
