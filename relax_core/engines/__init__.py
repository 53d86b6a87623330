"""Rollout engines behind :class:`relax_core.engines.base.RolloutEngine`, built by name."""

from __future__ import annotations

from relax_core.engines.base import RolloutEngine
from relax_core.errors import RelaxUserError


def build_engine(name: str, model_path: str, tokenizer, model_cfg, seed: int) -> RolloutEngine:
    """The engine ``rollout.engine`` names, loaded from ``model_path``."""
    if name == "torch":
        from relax_core.engines.torch_engine import TorchEngine
        from relax_models.loader import load_causal_lm

        model = load_causal_lm(model_path, model_cfg.dtype, model_cfg.attn_implementation)
        return TorchEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id], seed=seed)
    raise RelaxUserError(f"rollout.engine={name!r} is not available; choose one of ['torch']")
