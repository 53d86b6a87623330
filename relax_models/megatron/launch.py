"""What the launcher needs to know about the megatron backend *before* Ray starts.

The training world of one Actor group is the smallest number of processes every megatron parallel
dimension and ``trainer.dp_size`` replicas fit in (:func:`training_world_size`). Each process is one Actor
rank and gets the ``torch.distributed`` rank environment from ``relax_core.runtime.placement.rank_env`` (the
ranks meet wherever Ray puts them: ``join_rendezvous``); the ranks of one data-parallel replica share a
slice of each batch, the replicas split it.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from relax_models.errors import RelaxUserError
from relax_models.megatron.model import (
    ArchSpec,
    ParallelSizes,
    arch_from_hf_config,
    validate_parallel_sizes,
)

# ``model.family`` values the megatron backend trains (the weight bridge maps exactly these)
MEGATRON_FAMILIES = ("qwen3", "qwen3_moe")


def training_world_size(parallel: Any, dp_size: int = 1) -> int:
    """Processes one Actor group needs for ``trainer.megatron`` and ``trainer.dp_size``.

    ``lcm(tensor x pipeline x context x dp_size, expert_tensor x expert x pipeline)``: at least
    ``dp_size`` model replicas, and enough ranks for the expert grid (which may add replicas).
    """
    sizes = parallel if isinstance(parallel, ParallelSizes) else ParallelSizes.from_config(parallel)
    dense = sizes.tensor * sizes.pipeline * sizes.context
    expert = sizes.etp * sizes.expert * sizes.pipeline
    return math.lcm(max(dense, 1) * max(dp_size, 1), max(expert, 1))


def data_parallel_size(parallel: Any, dp_size: int = 1) -> int:
    """Model replicas in the training world; each trains on its own slice of every batch."""
    sizes = parallel if isinstance(parallel, ParallelSizes) else ParallelSizes.from_config(parallel)
    return training_world_size(sizes, dp_size) // (sizes.tensor * sizes.pipeline * sizes.context)


def _launch_arch(model_cfg: Any) -> ArchSpec | None:
    """The architecture the run will load: ``model.path``'s config.json, else the ``model.tiny`` spec.

    None when ``model.path`` is not a model folder: the loader reports that with its own message.
    """
    from transformers import AutoConfig

    if model_cfg.path:
        config_file = Path(model_cfg.path).expanduser() / "config.json"
        if not config_file.is_file():
            return None
        return arch_from_hf_config(AutoConfig.from_pretrained(config_file.parent))
    if model_cfg.tiny is None:
        return None
    spec = model_cfg.tiny if isinstance(model_cfg.tiny, dict) else dataclasses.asdict(model_cfg.tiny)
    spec = {k: v for k, v in spec.items() if v is not None and k not in ("vision", "audio")}
    # the tiny char tokenizer's vocabulary does not change any parallel-size rule; 64 keeps TP <= 64 even
    return arch_from_hf_config(AutoConfig.for_model(model_cfg.family, vocab_size=64, **spec))


def check_megatron_launch(cfg: Any) -> int:
    """Refuse a ``trainer.backend=megatron`` run that cannot work; returns its training world size.

    Checked: the model family, parallel sizes the backend does not run yet (pipeline, context), and
    every ``trainer.megatron`` size against the architecture and the world size (one message each,
    naming the key to change).
    """
    family = cfg.model.family
    if family not in MEGATRON_FAMILIES:
        raise RelaxUserError(
            f"trainer.backend=megatron trains model families {list(MEGATRON_FAMILIES)}; "
            f"model={cfg.model.name} is family {family!r}: use trainer=torch for it"
        )
    raw = cfg.trainer.megatron
    for name in ("tensor", "pipeline", "context", "expert", "expert_tensor"):
        value = getattr(raw, name, None) if not isinstance(raw, dict) else raw.get(name)
        if value is not None and value < 1:  # checked raw: ParallelSizes reads 0 as "unset"
            raise RelaxUserError(f"trainer.megatron.{name}={value} must be >= 1")
    sizes = ParallelSizes.from_config(raw)
    if sizes.pipeline > 1 or sizes.context > 1:
        raise RelaxUserError(
            f"trainer.megatron.pipeline={sizes.pipeline}, context={sizes.context}: the megatron backend runs "
            "tensor and expert parallelism only so far; set pipeline=1 and context=1"
        )
    world = training_world_size(sizes, cfg.trainer.dp_size)
    arch = _launch_arch(cfg.model)
    if arch is not None:
        validate_parallel_sizes(arch, sizes, world)
    return world
