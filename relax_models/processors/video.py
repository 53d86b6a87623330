"""Videos: decode with PyAV, sample frames at a target fps within min/max frames, size frames to a token
budget, and cut them into the flat patch layout of Qwen-style vision towers."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import av
import numpy as np

from relax_models.errors import RelaxUserError
from relax_models.processors.image import fit_size


@dataclass
class VideoClip:
    """Frames sampled from one video."""

    frames: np.ndarray  # [T, H, W, 3] uint8, T a multiple of the temporal patch size
    indices: list[int]  # source frame index of each sampled frame
    native_fps: float
    duration: float  # seconds

    @property
    def sample_fps(self) -> float:
        """Sampled frames per second of video."""
        return len(self.indices) / self.duration if self.duration > 0 else self.native_fps

    def group_timestamps(self, temporal_patch_size: int) -> list[float]:
        """Seconds at the middle of each temporal patch (mean of its first and last frame times)."""
        tp = temporal_patch_size
        return [
            (self.indices[i] + self.indices[i + tp - 1]) / 2 / self.native_fps
            for i in range(0, len(self.indices), tp)
        ]


def _open(item: Any) -> av.container.InputContainer:
    if isinstance(item, dict):
        item = item.get("bytes") or item.get("path")
    if isinstance(item, (bytes, bytearray)):
        return av.open(io.BytesIO(item))
    if isinstance(item, (str, Path)):
        if not Path(item).is_file():
            raise RelaxUserError(f"video file {str(item)!r} does not exist")
        return av.open(str(item))
    raise RelaxUserError(f"cannot read a video from a {type(item).__name__}")


def num_sampled_frames(
    total: int, native_fps: float, fps: float, min_frames: int, max_frames: int, temporal_patch_size: int
) -> int:
    """Frames to take: ``fps`` per second of video (at most every frame), clamped to [min_frames, max_frames],
    rounded up to a multiple of the temporal patch size (down if that would pass ``max_frames``)."""
    tp = temporal_patch_size
    n = min(round(total / native_fps * fps), total)
    n = min(max(n, min_frames, 1), max_frames)
    n = math.ceil(n / tp) * tp
    if n > max_frames:
        n = max(tp, max_frames // tp * tp)
    return n


def sample_video(
    item: Any, fps: float, min_frames: int, max_frames: int, temporal_patch_size: int = 2
) -> VideoClip:
    """Decode ``item`` (path, bytes or ``{"bytes"|"path": ...}``) and keep evenly spaced frames, see
    :func:`num_sampled_frames`. Frames are decoded once, in order; only the kept ones are converted."""
    with _open(item) as container:
        if not container.streams.video:
            raise RelaxUserError("video has no video stream")
        stream = container.streams.video[0]
        total = stream.frames
        if not total:  # no frame count in the header: count packets without decoding
            total = sum(1 for packet in container.demux(stream) if packet.size)
            container.seek(0)
        if not total:
            raise RelaxUserError("video has no frames")
        if stream.average_rate:
            native_fps = float(stream.average_rate)
        elif stream.duration and stream.time_base:
            native_fps = total / float(stream.duration * stream.time_base)
        else:
            raise RelaxUserError("video has neither a frame rate nor a duration")
        n = num_sampled_frames(total, native_fps, fps, min_frames, max_frames, temporal_patch_size)
        indices = np.linspace(0, total - 1, n).round().astype(int).tolist()
        wanted = set(indices)
        decoded: dict[int, np.ndarray] = {}
        last = None
        for i, frame in enumerate(container.decode(stream)):
            if i in wanted:
                decoded[i] = frame.to_ndarray(format="rgb24")
            last = i
            if i >= indices[-1]:
                break
    if not decoded:
        raise RelaxUserError("video could not be decoded")
    # a header may overstate the frame count: map missing tail indices to the last decoded frame
    kept = sorted(decoded)
    indices = [i if i in decoded else kept[-1] for i in indices]
    frames = np.stack([decoded[i] for i in indices])
    return VideoClip(frames=frames, indices=indices, native_fps=native_fps, duration=(last + 1) / native_fps)


def video_frame_size(
    n_frames: int,
    height: int,
    width: int,
    factor: int,
    temporal_patch_size: int,
    min_pixels: int,
    max_pixels: int,
    max_tokens: int,
) -> tuple[int, int]:
    """Frame (height, width) so that the clip costs at most ``max_tokens`` LLM tokens and each frame stays
    within [min_pixels, max_pixels] (the budget wins over ``min_pixels``)."""
    groups = max(1, n_frames // temporal_patch_size)
    cap = min(max_pixels, max_tokens // groups * factor * factor)
    h, w = fit_size(height, width, factor, min(min_pixels, cap), cap)
    if h * w > cap:
        h, w = fit_size(height, width, factor, 0, cap)
    return h, w


def patchify_frames(
    frames: np.ndarray, patch_size: int, merge_size: int, temporal_patch_size: int
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """``[T, C, H, W]`` float frames -> (``[t*h*w, C*tp*p*p]`` patches, ``(t, h, w)`` grid).

    Patches are ordered by temporal group, then merge window (row-major), then position inside the window,
    and each patch flattens as (channel, time, row, column): the layout Qwen2/3-VL vision towers read.
    A last frame is repeated to complete the final temporal group.
    """
    tp, p, m = temporal_patch_size, patch_size, merge_size
    if frames.shape[0] % tp:
        pad = np.repeat(frames[-1:], tp - frames.shape[0] % tp, axis=0)
        frames = np.concatenate([frames, pad])
    t, c, h, w = frames.shape
    gt, gh, gw = t // tp, h // p, w // p
    if gh % m or gw % m or h % p or w % p:
        raise ValueError(f"frame size {h}x{w} is not a multiple of patch_size*merge_size={p * m}")
    x = frames.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x.reshape(gt * gh * gw, c * tp * p * p)), (gt, gh, gw)
