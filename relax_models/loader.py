"""One loader for every model folder: a tiny model built in the run dir or a real HF checkpoint."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from relax_core.errors import RelaxUserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(model_cfg, output_dir: str, seed: int) -> str:
    """The folder to load: ``model.path`` if set (must exist), else the tiny spec built under the run dir."""
    if model_cfg.path:
        path = Path(model_cfg.path).expanduser()
        if not (path / "config.json").is_file():
            raise RelaxUserError(
                f"model.path={model_cfg.path!r} is not a model folder (no config.json there); "
                "point it at a local Hugging Face checkpoint folder"
            )
        return str(path)
    if model_cfg.tiny is None:
        raise RelaxUserError(f"model {model_cfg.name!r} has no weights: set model.path=/path/to/hf/folder")
    from relax_models.tiny import build_tiny_qwen3

    spec = model_cfg.tiny if isinstance(model_cfg.tiny, dict) else dataclasses.asdict(model_cfg.tiny)
    return str(build_tiny_qwen3(Path(output_dir) / "model_init", seed=seed, **spec))


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The folder's tokenizer, left-padding for generation; a pad token is added from EOS if missing."""
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(path: str, dtype: str = "float32", attn_implementation: str = "sdpa") -> torch.nn.Module:
    """An ``AutoModelForCausalLM`` from a local folder, on CPU, in ``dtype``."""
    if dtype not in DTYPES:
        raise RelaxUserError(f"model.dtype={dtype!r} is not one of {sorted(DTYPES)}")
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=DTYPES[dtype], attn_implementation=attn_implementation
    )


def model_family(path: str) -> str:
    """The HF ``model_type`` of a folder (e.g. ``qwen3``, ``qwen3_moe``)."""
    return AutoConfig.from_pretrained(path).model_type
