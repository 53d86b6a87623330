"""Random-init tiny models written to a folder exactly like a downloaded checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from relax_models.families import TINY_MARKER
from relax_models.tokenizer import build_char_tokenizer


def build_tiny_qwen3(folder: str | Path, seed: int, **dims: int | bool) -> Path:
    """Write a random-init ``Qwen3ForCausalLM`` (``dims`` override Qwen3Config fields) and a char tokenizer.

    Idempotent: an existing folder built with the same seed and dims is reused.
    """
    folder = Path(folder)
    recipe = {"seed": seed, **dims}
    marker = folder / TINY_MARKER
    if marker.exists() and json.loads(marker.read_text()) == recipe:
        return folder
    tokenizer = build_char_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        rope_theta=10000.0,
        **dims,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    marker.write_text(json.dumps(recipe))
    return folder
