"""Preprocessing of images, videos and audio into the token ids and tensors multimodal models take."""

from relax_models.config import MediaSettings
from relax_models.processors.audio import audio_token_count, load_audio, resample
from relax_models.processors.image import fit_size, image_token_count, load_image, resize_image
from relax_models.processors.processor import (
    DEFAULT_VIDEO_MAX_TOKENS,
    MultimodalProcessor,
    build_multimodal_inputs,
    load_processor,
    multimodal_nbytes,
)
from relax_models.processors.video import VideoClip, patchify_frames, sample_video, video_frame_size

__all__ = [
    "DEFAULT_VIDEO_MAX_TOKENS",
    "MediaSettings",
    "MultimodalProcessor",
    "VideoClip",
    "audio_token_count",
    "build_multimodal_inputs",
    "fit_size",
    "image_token_count",
    "load_audio",
    "load_image",
    "load_processor",
    "multimodal_nbytes",
    "patchify_frames",
    "resample",
    "resize_image",
    "sample_video",
    "video_frame_size",
]
