"""Helpers shared by the engine tests (a module, not conftest, so its name cannot clash across test dirs)."""

from __future__ import annotations

from pathlib import Path

from relax_core.engines.torch_engine import TorchEngine
from relax_models.loader import load_causal_lm


def make_engine(model_dir: Path, tokenizer, **kwargs) -> TorchEngine:
    model = load_causal_lm(str(model_dir))
    return TorchEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id], tokenizer=tokenizer, **kwargs)
