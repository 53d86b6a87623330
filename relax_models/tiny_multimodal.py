"""Random-init tiny twins of Qwen3-MoE, Qwen3-VL (dense, MoE) and the Qwen3-Omni thinker, written to a folder
like a downloaded checkpoint: real transformers model classes with tiny dims, a character tokenizer carrying
the architecture's special tokens, and processor settings (image processor, audio feature extractor).

Text dims are flat keyword arguments (the ``TinyModelSpec`` fields); ``vision=`` / ``audio=`` dicts override
the towers' config fields. Each builder is idempotent: a folder built with the same recipe is reused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from relax_models.families import TINY_MARKER, get_family
from relax_models.processors.processor import DEFAULT_TOKENS, MultimodalProcessor
from relax_models.tokenizer import CHARACTERS, SPECIAL_TOKENS, build_char_tokenizer

TEXT_DIMS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}
MOE_DIMS: dict[str, Any] = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
VISION_DIMS: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 256,
}
AUDIO_DIMS: dict[str, Any] = {
    "num_mel_bins": 128,
    "encoder_layers": 2,
    "encoder_attention_heads": 2,
    "encoder_ffn_dim": 64,
    "d_model": 32,
    "downsample_hidden_size": 16,
    "n_window": 50,
    "n_window_infer": 800,
    "max_source_positions": 1500,
}
VISION_ROLES = ("image_token", "video_token", "vision_bos_token", "vision_eos_token")
AUDIO_ROLES = ("audio_token", "audio_bos_token", "audio_eos_token")


def build_multimodal_tokenizer(audio: bool = False) -> PreTrainedTokenizerFast:
    """The character tokenizer of ``relax_models.tokenizer`` (same ids) plus the vision (and audio)
    placeholder tokens, exposed as ``tokenizer.image_token`` / ``image_token_id`` etc."""
    roles = VISION_ROLES + (AUDIO_ROLES if audio else ())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab.setdefault(ch, len(vocab))
    for role in roles:
        vocab.setdefault(DEFAULT_TOKENS[role], len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        additional_special_tokens=[DEFAULT_TOKENS[r] for r in roles],
        extra_special_tokens={r: DEFAULT_TOKENS[r] for r in roles},
    )


def _reuse(folder: Path, recipe: dict[str, Any]) -> bool:
    marker = folder / TINY_MARKER
    return marker.exists() and json.loads(marker.read_text()) == recipe


def _finish(folder: Path, recipe: dict[str, Any], model: torch.nn.Module, processor: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    (folder / TINY_MARKER).write_text(json.dumps(recipe))
    return folder


def _mrope(head_dim: int, omni: bool) -> dict[str, Any]:
    """Default rope with an interleaved 3-D (time, height, width) section split of ``head_dim / 2``."""
    half = head_dim // 2
    hw = half * 5 // 16  # the 24/20/20 split of a 128-dim head, scaled
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [half - 2 * hw, hw, hw]}
    rope["interleaved" if omni else "mrope_interleaved"] = True
    return rope


def _text_config(
    tokenizer: PreTrainedTokenizerFast, dims: dict[str, Any], moe: bool, omni: bool = False
) -> dict[str, Any]:
    text = {**TEXT_DIMS, **(MOE_DIMS if moe else {}), **dims}
    text.pop("tie_word_embeddings")
    text.update(
        vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
    )
    text["rope_parameters"] = _mrope(text["head_dim"], omni)
    return text


def _vision_config(overrides: dict[str, Any] | None, out_hidden: int, text_layers: int) -> dict[str, Any]:
    vision = {**VISION_DIMS, **(overrides or {})}
    vision["out_hidden_size"] = out_hidden
    vision.setdefault("deepstack_visual_indexes", list(range(min(2, vision["depth"], text_layers))))
    return vision


def _image_processor(vision: dict[str, Any]) -> Any:
    from transformers import Qwen2VLImageProcessorPil

    factor = vision["patch_size"] * vision["spatial_merge_size"]
    return Qwen2VLImageProcessorPil(
        patch_size=vision["patch_size"],
        temporal_patch_size=vision["temporal_patch_size"],
        merge_size=vision["spatial_merge_size"],
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        size={"shortest_edge": 4 * factor * factor, "longest_edge": 64 * factor * factor},
    )


def build_tiny_qwen3_moe(folder: str | Path, seed: int, **dims: Any) -> Path:
    """A random-init ``Qwen3MoeForCausalLM`` with the character tokenizer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    folder = Path(folder)
    recipe = {"family": "qwen3_moe", "seed": seed, **dims}
    if _reuse(folder, recipe):
        return folder
    tokenizer = build_char_tokenizer()
    config = Qwen3MoeConfig(
        **{**TEXT_DIMS, **MOE_DIMS, **dims},
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(seed)
    return _finish(folder, recipe, Qwen3MoeForCausalLM(config), tokenizer)


def _build_tiny_vl(
    folder: str | Path, seed: int, moe: bool, vision: dict | None, dims: dict[str, Any]
) -> Path:
    from transformers import (
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeConfig,
        Qwen3VLMoeForConditionalGeneration,
    )

    family = "qwen3_vl_moe" if moe else "qwen3_vl"
    folder = Path(folder)
    recipe = {"family": family, "seed": seed, "vision": vision, **dims}
    if _reuse(folder, recipe):
        return folder
    tokenizer = build_multimodal_tokenizer(audio=False)
    text = _text_config(tokenizer, dims, moe)
    vision_cfg = _vision_config(vision, text["hidden_size"], text["num_hidden_layers"])
    config_cls, model_cls = (
        (Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration)
        if moe
        else (Qwen3VLConfig, Qwen3VLForConditionalGeneration)
    )
    config = config_cls(
        text_config=text,
        vision_config=vision_cfg,
        image_token_id=tokenizer.image_token_id,
        video_token_id=tokenizer.video_token_id,
        vision_start_token_id=tokenizer.vision_bos_token_id,
        vision_end_token_id=tokenizer.vision_eos_token_id,
        tie_word_embeddings=dims.get("tie_word_embeddings", TEXT_DIMS["tie_word_embeddings"]),
    )
    torch.manual_seed(seed)
    processor = MultimodalProcessor(tokenizer, family, image_processor=_image_processor(vision_cfg))
    return _finish(folder, recipe, model_cls(config), processor)


def build_tiny_qwen3_vl(folder: str | Path, seed: int, vision: dict | None = None, **dims: Any) -> Path:
    """A random-init ``Qwen3VLForConditionalGeneration`` (dense) with its tokenizer and image processor."""
    return _build_tiny_vl(folder, seed, False, vision, dims)


def build_tiny_qwen3_vl_moe(folder: str | Path, seed: int, vision: dict | None = None, **dims: Any) -> Path:
    """A random-init ``Qwen3VLMoeForConditionalGeneration`` with its tokenizer and image processor."""
    return _build_tiny_vl(folder, seed, True, vision, dims)


def _talker_configs(thinker_hidden: int, thinker_layers: int) -> dict[str, Any]:
    """A one-layer talker and code2wav: present only so a folder has a full checkpoint's layout (their
    weights under ``talker.`` / ``code2wav.``); they are never run (speech output is out of scope)."""
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    small |= {"num_key_value_heads": 1}
    talker_text = {**small, "head_dim": 16, "vocab_size": 64, "moe_intermediate_size": 16, "num_experts": 2}
    talker_text |= {
        "num_experts_per_tok": 1,
        "shared_expert_intermediate_size": 32,
        "rope_parameters": _mrope(16, True),
    }
    predictor = {**small, "head_dim": 16, "vocab_size": 64, "layer_types": ["full_attention"]}
    talker = {
        "text_config": talker_text,
        "code_predictor_config": predictor,
        "thinker_hidden_size": thinker_hidden,
        "accept_hidden_layer": thinker_layers,
        "spatial_merge_size": VISION_DIMS["spatial_merge_size"],
    }
    code2wav = {**small, "decoder_dim": 32, "codebook_size": 64}
    return {"talker_config": talker, "code2wav_config": code2wav}


def build_tiny_qwen3_omni(
    folder: str | Path,
    seed: int,
    vision: dict | None = None,
    audio: dict | None = None,
    talker: bool = False,
    **dims: Any,
) -> Path:
    """A random-init Qwen3-Omni checkpoint (``model_type: qwen3_omni_moe``) with tokenizer, image processor
    and audio feature extractor. By default it holds only the thinker (``enable_audio_output: false``);
    ``talker=True`` adds a tiny talker + code2wav so the folder has a released checkpoint's full layout.

    Load the trainable thinker with ``FAMILIES["qwen3_omni"].load(folder)``, as for a real checkpoint.
    """
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration, WhisperFeatureExtractor

    folder = Path(folder)
    recipe = {
        "family": "qwen3_omni",
        "seed": seed,
        "vision": vision,
        "audio": audio,
        "talker": talker,
        **dims,
    }
    if _reuse(folder, recipe):
        return folder
    tokenizer = build_multimodal_tokenizer(audio=True)
    text = _text_config(tokenizer, dims, moe=True, omni=True)
    vision_cfg = _vision_config(vision, text["hidden_size"], text["num_hidden_layers"])
    audio_cfg = {**AUDIO_DIMS, **(audio or {}), "output_dim": text["hidden_size"]}
    thinker = {
        "text_config": text,
        "vision_config": vision_cfg,
        "audio_config": audio_cfg,
        "image_token_id": tokenizer.image_token_id,
        "video_token_id": tokenizer.video_token_id,
        "audio_token_id": tokenizer.audio_token_id,
        "audio_start_token_id": tokenizer.audio_bos_token_id,
        "audio_end_token_id": tokenizer.audio_eos_token_id,
        "vision_start_token_id": tokenizer.vision_bos_token_id,
        "vision_end_token_id": tokenizer.vision_eos_token_id,
        "tie_word_embeddings": dims.get("tie_word_embeddings", TEXT_DIMS["tie_word_embeddings"]),
    }
    extra = _talker_configs(text["hidden_size"], text["num_hidden_layers"]) if talker else {}
    config = Qwen3OmniMoeConfig(thinker_config=thinker, enable_audio_output=talker, **extra)
    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(config)
    features = WhisperFeatureExtractor(
        feature_size=audio_cfg["num_mel_bins"],
        sampling_rate=16000,
        hop_length=160,
        n_fft=400,
        chunk_length=30,
    )
    processor = MultimodalProcessor(
        tokenizer,
        "qwen3_omni",
        image_processor=_image_processor(vision_cfg),
        feature_extractor=features,
        audio_n_window=audio_cfg["n_window"],
    )
    return _finish(folder, recipe, model, processor)


def build_tiny(family: str, folder: str | Path, seed: int, **dims: Any) -> Path:
    """The tiny twin of ``family`` (see ``relax_models.families``)."""
    return get_family(family).build_tiny(folder, seed, **dims)
