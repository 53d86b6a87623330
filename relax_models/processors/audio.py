"""Audio: read with soundfile, mix to mono, resample with SciPy's polyphase filter,
and count the LLM tokens a Qwen3-Omni audio tower makes of a mel spectrogram."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import numpy as np
import soundfile

from relax_models.errors import RelaxUserError


def load_audio(item: Any) -> tuple[np.ndarray, int]:
    """(mono float32 waveform, sample rate) from a path, raw bytes, ``(array, rate)``, or a datasets-style
    dict (``{"array": ..., "sampling_rate": ...}``, ``{"bytes": ...}`` or ``{"path": ...}``)."""
    if isinstance(item, tuple) and len(item) == 2:
        wave, rate = np.asarray(item[0], dtype=np.float32), int(item[1])
    elif isinstance(item, dict) and "array" in item:
        wave, rate = np.asarray(item["array"], dtype=np.float32), int(item["sampling_rate"])
    else:
        if isinstance(item, dict):
            item = item.get("bytes") or item.get("path")
        if isinstance(item, (bytes, bytearray)):
            source: Any = io.BytesIO(item)
        elif isinstance(item, (str, Path)):
            if not Path(item).is_file():
                raise RelaxUserError(f"audio file {str(item)!r} does not exist")
            source = str(item)
        else:
            raise RelaxUserError(f"cannot read audio from a {type(item).__name__}")
        try:
            wave, rate = soundfile.read(source, dtype="float32", always_2d=True)
        except soundfile.LibsndfileError as err:
            raise RelaxUserError(f"cannot decode audio: {err}") from None
    if wave.ndim == 2:  # [frames, channels] -> mono
        wave = wave.mean(axis=1)
    if wave.size == 0:
        raise RelaxUserError("audio clip is empty")
    return np.ascontiguousarray(wave, dtype=np.float32), rate


def resample(wave: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """Resample by the rational factor ``rate_out / rate_in`` (SciPy's polyphase filter: zero-stuff, Kaiser
    windowed-sinc low-pass below the lower Nyquist rate, decimate). Output length is
    ``ceil(len(wave) * rate_out / rate_in)``."""
    from scipy.signal import resample_poly

    g = math.gcd(rate_in, rate_out)
    up, down = rate_out // g, rate_in // g
    if up == down:
        return np.asarray(wave, dtype=np.float32)
    return resample_poly(np.asarray(wave, dtype=np.float64), up, down).astype(np.float32)


def audio_token_count(num_frames: int, n_window: int = 50) -> int:
    """LLM tokens a Qwen3-Omni audio tower emits for ``num_frames`` mel frames.

    The tower cuts features into windows of ``2 * n_window`` frames; a full window yields 13 tokens and the
    remainder is halved (rounding up) three times by its stride-2 convolutions.
    """
    full, rest = divmod(num_frames, 2 * n_window)
    for _ in range(3):
        rest = (rest + 1) // 2
    return full * 13 + rest
