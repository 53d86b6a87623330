"""Audio: read with soundfile, mix to mono, resample with a windowed-sinc polyphase filter (numpy only),
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


def resample(
    wave: np.ndarray,
    rate_in: int,
    rate_out: int,
    half_width: int = 16,
    rolloff: float = 0.94,
    kaiser_beta: float = 8.0,
) -> np.ndarray:
    """Resample by the rational factor ``rate_out / rate_in`` with a Kaiser-windowed sinc low-pass.

    Equivalent to zero-stuffing by ``up``, low-pass filtering below the lower Nyquist rate (times
    ``rolloff``) and keeping every ``down``-th sample, computed polyphase: outputs ``k = r, r + up, ...``
    share one sub-filter and read input windows ``down`` samples apart, so each of the ``up`` phases is one
    matrix-vector product. ``half_width`` is the filter's half length in periods of the slower rate.
    Output length is ``ceil(len(wave) * rate_out / rate_in)``.
    """
    g = math.gcd(rate_in, rate_out)
    up, down = rate_out // g, rate_in // g
    x = np.asarray(wave, dtype=np.float64)
    if up == down:
        return x.astype(np.float32)
    cutoff = rolloff / max(up, down)  # relative to the Nyquist rate of the up-sampled signal
    half = half_width * max(up, down)
    taps = np.arange(-half, half + 1)
    kernel = cutoff * np.sinc(cutoff * taps) * np.kaiser(2 * half + 1, kaiser_beta) * up
    n_out = -(-len(x) * up // down)
    width = 2 * half // up + 1  # input samples under the filter for one output
    padded = np.concatenate([np.zeros(width), x, np.zeros(width + 1)])
    windows = np.lib.stride_tricks.sliding_window_view(padded, width)
    out = np.empty(n_out)
    for r in range(min(up, n_out)):
        first = -((half - r * down) // up)  # ceil((r*down - half) / up): first input under the filter
        tap = r * down - (first + np.arange(width)) * up + half
        sub = np.where((tap >= 0) & (tap <= 2 * half), kernel[np.clip(tap, 0, 2 * half)], 0.0)
        count = len(range(r, n_out, up))
        out[r::up] = windows[first + width : first + width + count * down : down] @ sub
    return out.astype(np.float32)


def audio_token_count(num_frames: int, n_window: int = 50) -> int:
    """LLM tokens a Qwen3-Omni audio tower emits for ``num_frames`` mel frames.

    The tower cuts features into windows of ``2 * n_window`` frames; a full window yields 13 tokens and the
    remainder is halved (rounding up) three times by its stride-2 convolutions.
    """
    full, rest = divmod(num_frames, 2 * n_window)
    for _ in range(3):
        rest = (rest + 1) // 2
    return full * 13 + rest
