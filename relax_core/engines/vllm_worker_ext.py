"""Weight loading inside vLLM's workers, registered by name through vLLM's ``worker_extension_cls``.

Runs in the vLLM environment (imports torch, vLLM and ``weight_broadcast`` only). vLLM mixes this class
into its worker, so ``self`` is the worker and the server calls the methods with
``collective_rpc("<method name>", ...)``: plain data in, no pickled callables.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from relax_core.engines.weight_broadcast import join_group

# every reload warns that the rotary embedding "failed to load weights": its cos/sin cache is a buffer no
# checkpoint holds, and vLLM puts it back; one line per layer per step would bury the run's log
logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
    lambda record: not record.getMessage().startswith("RotaryEmbedding:")
)


class WeightLoaderExtension:
    """Receives weights over a torch.distributed group (or reads a folder) and loads them into the model."""

    def _tp_rank(self) -> int:
        from vllm.distributed.parallel_state import get_tp_group

        return get_tp_group().rank_in_group

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        groups = self.__dict__.setdefault("_relax_weight_groups", {})
        groups[group_name] = join_group(
            master_address, master_port, rank_offset + self._tp_rank(), world_size, group_name, backend
        )

    def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str, load: bool
    ) -> None:
        """Receive one broadcast (from rank 0) per name, in order; with ``load``, load every tensor received
        since the last load (a version's buckets go in together: vLLM reloads whole layers)."""
        group = self._relax_weight_groups[group_name]
        device = self.device if torch.cuda.is_available() else torch.device("cpu")
        pending = self.__dict__.setdefault("_relax_pending_weights", [])
        for name, dtype, shape in zip(names, dtypes, shapes):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            group.broadcast(tensor, 0).wait()
            pending.append((name, tensor))
        if load:
            self._reload(pending)
            pending.clear()

    def load_weights_from_folder(self, path: str) -> None:
        """The disk fallback: every ``*.safetensors`` file of an HF folder."""
        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        self._reload([item for f in files for item in load_file(str(f)).items()])

    def _reload(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """vLLM's in-place reload from HF-format tensors: it re-runs the per-layer processing (e.g. the CPU
        backend's repacking) that a bare ``model.load_weights`` after startup would miss."""
        self.model_runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)

    def close_weights_update_group(self, group_name: str) -> None:
        self.__dict__.get("_relax_weight_groups", {}).pop(group_name, None)
