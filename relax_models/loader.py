"""One loader for every model folder: a tiny model built in the run dir or a real HF checkpoint."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase
from transformers.modeling_outputs import CausalLMOutputWithPast

from relax_models.errors import RelaxUserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# name of a forward's KV-cache argument and output: transformers 5.24 renamed ``past_key_values`` to ``cache``
# (the old name still works there, with a FutureWarning per process); earlier versions know only the old one
KV_CACHE_KEY = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def resolve_model_path(model_cfg, output_dir: str, seed: int) -> str:
    """The folder to load: ``model.path`` if set (must exist), else the tiny spec built under the run dir."""
    if model_cfg.path:
        path = Path(model_cfg.path).expanduser()
        if not (path / "config.json").is_file():
            raise RelaxUserError(
                f"model.path={model_cfg.path!r} is not a model folder (no config.json there); "
                "point it at a local Hugging Face checkpoint folder"
            )
        problem = model_folder_problem(path)
        if problem:
            raise RelaxUserError(f"model.path={model_cfg.path!r}: {problem}")
        return str(path)
    if model_cfg.tiny is None:
        raise RelaxUserError(f"model {model_cfg.name!r} has no weights: set model.path=/path/to/hf/folder")
    from relax_models.families import get_family

    family = get_family(model_cfg.family)
    spec = model_cfg.tiny if isinstance(model_cfg.tiny, dict) else dataclasses.asdict(model_cfg.tiny)
    spec = dict(spec)
    for tower, kinds in (("vision", {"image", "video"}), ("audio", {"audio"})):
        if spec.get(tower) is not None and not kinds & family.inputs:
            raise RelaxUserError(
                f"model.tiny.{tower} is set but model family {family.name} has no {tower} tower; remove it"
            )
        if spec.get(tower) is None:
            spec.pop(tower, None)
    return str(family.build_tiny(Path(output_dir) / "model_init", seed=seed, **spec))


def model_folder_problem(path: Path) -> str | None:
    """What makes a model folder unloadable, in one line, checked before any process loads it: a
    ``config.json`` that is not a JSON object, a ``*.safetensors`` file whose header does not parse or whose
    tensors reach past its end (a truncated copy or download). None when it looks whole."""
    config = path / "config.json"
    try:
        if not isinstance(json.loads(config.read_text(encoding="utf-8")), dict):
            return f"{config} is not a JSON object; restore it from the original checkpoint"
    except (OSError, ValueError) as err:
        return f"{config} is not valid JSON ({err}); restore it from the original checkpoint"
    for file in sorted(path.glob("*.safetensors")):
        size = file.stat().st_size
        try:
            with file.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > size - 8:
                    raise ValueError(f"header of {length} bytes in a {size}-byte file")
                header = json.loads(f.read(length))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error) as err:
            return f"{file} is not a readable safetensors file ({err}); copy or download it again"
        if 8 + length + end > size:
            return f"{file} is truncated ({size} bytes, its header needs {8 + length + end}); copy or download it again"
    return None


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The folder's tokenizer, left-padding for generation; a pad token is added from EOS if missing."""
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(
    path: str,
    dtype: str = "float32",
    attn_implementation: str = "sdpa",
    family: str | None = None,
    device: torch.device | str = "cpu",
) -> torch.nn.Module:
    """The trainable model of a local folder, on ``device`` (see ``relax_core.runtime.placement.role_device``),
    in ``dtype``.

    ``family`` (``model.family``) picks the class from ``relax_models.families`` and checks the folder's
    ``model_type`` against it; without it the family follows from the ``model_type``, and a folder of no
    known family falls back to ``AutoModelForCausalLM``. Multimodal families load their conditional-
    generation class (for Qwen3-Omni: the thinker), which a plain ``AutoModelForCausalLM`` would not.

    ``device="meta"`` builds the same module without reading the weights (see ``FamilySpec.empty``).
    """
    if dtype not in DTYPES:
        raise RelaxUserError(f"model.dtype={dtype!r} is not one of {sorted(DTYPES)}")
    from relax_models.families import FAMILIES, family_for_model_type, get_family

    kwargs = {"dtype": DTYPES[dtype], "attn_implementation": attn_implementation}
    empty = torch.device(device).type == "meta"
    if family is None:
        model_type = model_family(path)
        known = {t for spec in FAMILIES.values() for t in spec.model_types}
        if model_type not in known:
            if empty:
                with torch.device("meta"):
                    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), **kwargs)
            return AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device)
        family = family_for_model_type(model_type)
    spec = get_family(family)
    return spec.empty(path, **kwargs) if empty else spec.load(path, **kwargs).to(device)


def model_family(path: str) -> str:
    """The HF ``model_type`` of a folder (e.g. ``qwen3``, ``qwen3_moe``)."""
    return AutoConfig.from_pretrained(path).model_type
