"""Settings of the model layer that the engine's config schema extends (``modality``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MediaSettings:
    """How media are sized and sampled before they become tokens (the engine's ``modality`` config extends
    this with the dataset columns)."""

    min_pixels: int = 3136
    max_pixels: int = 401408
    video_fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 32
    audio_sample_rate: int = 16000
    # LLM tokens one video may cost (null: relax_models.processors.DEFAULT_VIDEO_MAX_TOKENS)
    video_max_tokens: int | None = None
