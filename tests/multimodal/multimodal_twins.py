"""Configs of the tiny multimodal twins and their synthetic tasks, shared by the multimodal tests."""

from __future__ import annotations

from tiny_dims import SMALL_DIMS

from relax_core.config.schema import ModelConfig, TinyModelSpec

TASKS = {
    # family -> (synthetic task, modality name, modality.keys)
    "qwen3_vl": ("vision_colors", "vision", {"image": "images"}),
    "qwen3_omni": ("audio_tones", "audio", {"audio": "audios"}),
}


def tiny_model_cfg(family: str) -> ModelConfig:
    """The model config the conf/model/tiny_<family>.yaml twins use."""
    spec = TinyModelSpec(**{**SMALL_DIMS, "max_position_embeddings": 4096})
    return ModelConfig(name=f"tiny_{family}", family=family, tiny=spec)
