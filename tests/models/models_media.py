"""Real media files synthesized for tests: MPEG-4 videos (PyAV), WAV files (soundfile), random images."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import soundfile

MULTIMODAL_FAMILIES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_omni")


def write_video(path: Path, n_frames: int, fps: int, height: int = 64, width: int = 96) -> Path:
    """An MPEG-4 video whose frame i is uniformly gray at level 6*i (so decoded frames reveal their index)."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps, options={"qscale": "1"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(n_frames):
            frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), 6 * i, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_wav(path: Path, seconds: float, rate: int, freq: float = 1000.0, channels: int = 2) -> Path:
    t = np.arange(round(seconds * rate)) / rate
    wave = 0.5 * np.sin(2 * np.pi * freq * t)
    soundfile.write(str(path), np.stack([wave] * channels, axis=1), rate, subtype="FLOAT")
    return path


def random_image(height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
