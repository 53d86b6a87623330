"""Make megatron-core 0.16.1 run on a machine without CUDA (tests, CPU development).

megatron-core assumes a GPU in three places that matter for a plain ``GPTModel`` forward/backward:

1. ``torch.cuda.current_device()`` is called to place freshly allocated tensors (attention scores buffer,
   router buffers, gathered activations). On a CPU-only torch build it raises, so we redirect it to
   return ``"cpu"``, which every ``device=`` argument accepts.
2. The tensor-parallel RNG tracker forks CUDA generator states around dropout and weight init. We install
   megatron's own *inference* tracker, whose ``fork`` is a no-op context, so the CPU default generator is
   used (dropout is 0 in our configs, and initial weights come from a checkpoint, not from this RNG).
3. Collectives use NCCL by default; on CPU the default process group must be ``gloo``.
4. Without Transformer Engine, ``moe_utils.te_general_gemm`` is never defined although the MoE router's
   gating GEMM tests it against ``None``; we define it as ``None`` so the plain ``torch.mm`` path runs
   (:func:`fill_missing_transformer_engine`, also needed on a GPU without TE).

Everything here is process-global and idempotent, and :func:`enable_cpu_shim` does nothing when CUDA is
available, so GPU runs never see it.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from relax_models.devices import local_cuda_index
from relax_models.ports import free_port

_ORIGINAL_CURRENT_DEVICE = torch.cuda.current_device
_ENABLED = False


def _cpu_current_device() -> str:
    return "cpu"


def cuda_available() -> bool:
    """Whether the real CUDA path should be taken (the shim stays off)."""
    return torch.cuda.is_available()


def fill_missing_transformer_engine() -> None:
    """Define the TE symbols megatron-core 0.16.1 reads unguarded when TE is absent (as ``None``)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def enable_cpu_shim() -> bool:
    """Apply the CPU redirections if there is no GPU; returns whether the shim is active."""
    global _ENABLED
    if cuda_available():
        return False
    fill_missing_transformer_engine()
    if not _ENABLED:
        torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
        _ENABLED = True
    # Reset every time: megatron helpers (e.g. model_parallel_cuda_manual_seed) may install the
    # CUDA tracker again, which would fail on the first fork.
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    return True


def disable_cpu_shim() -> None:
    """Undo the ``torch.cuda.current_device`` redirection (tests that need a clean torch)."""
    global _ENABLED
    torch.cuda.current_device = _ORIGINAL_CURRENT_DEVICE  # type: ignore[assignment]
    _ENABLED = False


def init_process_group(
    rank: int | None = None, world_size: int | None = None, port: int | None = None
) -> None:
    """Start the default process group if none exists: gloo without a GPU, NCCL with one.

    ``rank``/``world_size`` default to the ``RANK``/``WORLD_SIZE`` environment variables (torchrun, or
    what a Ray actor group sets), else a single process. A single-process run (the common CPU case)
    needs a group too, because megatron-core builds its tensor/pipeline/expert groups from it.
    """
    if dist.is_initialized():
        return
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if world_size == 1 and port is None:
        # a lone process meets only itself: an inherited MASTER_PORT (a Ray worker started from a process
        # that ran a group earlier) may still be held by that group, so always take a fresh local port
        os.environ["MASTER_ADDR"], port = "127.0.0.1", free_port()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if port is not None:
        os.environ["MASTER_PORT"] = str(port)
    elif "MASTER_PORT" not in os.environ:
        raise RuntimeError("MASTER_PORT must be set (or port given) when world_size > 1")
    backend = "nccl" if cuda_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_cuda_index(torch.cuda.device_count()))  # the device role_device() picks
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
