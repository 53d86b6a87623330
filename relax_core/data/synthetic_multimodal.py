"""Synthetic multimodal tasks: questions whose answer is only in the image or the sound.

Each task is a ``relax_core.data.synthetic`` entry like the text ``digits`` task. A row carries its media in
memory under ``_media`` and a ``_key`` that tells apart rows with the same question text;
:func:`relax_core.data.synthetic.generate_synthetic` writes the media to files in the ``images`` / ``audios``
columns, which ``modality.keys`` points at. Answers are letters scored by the ``multiple_choice`` reward;
the option order is fixed, so only the media tell the answers apart.
"""

from __future__ import annotations

import random
import string
from typing import TYPE_CHECKING

from relax_core.data.synthetic import synthetic_task
from relax_core.errors import RelaxUserError

if TYPE_CHECKING:
    from relax_core.config.schema import DataConfig

# name -> RGB; a row jitters its colour so no two images are alike
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 70, 220),
    "yellow": (230, 210, 40),
    "purple": (150, 60, 190),
    "cyan": (40, 200, 210),
}
# tone choices: log-spaced pitches, an octave apart from 250 Hz
TONES_HZ = (250.0, 500.0, 1000.0, 2000.0, 4000.0, 6000.0)
AUDIO_RATE = 16000


def _options(cfg: DataConfig, names: list[str]) -> list[str]:
    if not 2 <= cfg.num_choices <= len(names):
        raise RelaxUserError(
            f"data.num_choices={cfg.num_choices} must be between 2 and {len(names)} for data.synthetic="
            f"{cfg.synthetic!r}"
        )
    return names[: cfg.num_choices]


def _question(marker: str, what: str, options: list[str]) -> str:
    letters = string.ascii_uppercase
    return f"{marker}{what}? " + " ".join(f"{letters[i]}={o}" for i, o in enumerate(options))


@synthetic_task("vision_colors")
def vision_colors_row(rng: random.Random, cfg: DataConfig) -> dict:
    """``<image>colour? A=red B=green ...`` -> the letter of the colour of the square on a noisy background.

    The square's size, place and exact shade vary, so the vision tower has to find it.
    """
    import numpy as np

    options = _options(cfg, list(COLORS))
    answer = rng.randrange(len(options))
    side = cfg.image_size
    size = rng.randint(side // 3, side * 2 // 3)
    top, left = rng.randint(0, side - size), rng.randint(0, side - size)
    shade = [max(0, min(255, c + rng.randint(-25, 25))) for c in COLORS[options[answer]]]
    noise = np.random.default_rng(rng.getrandbits(32))
    image = noise.integers(90, 166, (side, side, 3), dtype=np.uint8)
    image[top : top + size, left : left + size] = np.asarray(shade, dtype=np.uint8)
    return {
        "prompt": _question("<image>", "colour", options),
        "label": string.ascii_uppercase[answer],
        "metadata": {"task": "vision_colors", "choices": options},
        "_media": {"image": [image]},
        "_key": f"{answer}-{size}-{top}-{left}-{shade}",
    }


@synthetic_task("audio_tones")
def audio_tones_row(rng: random.Random, cfg: DataConfig) -> dict:
    """``<audio>pitch? A=250Hz B=500Hz ...`` -> the letter of the tone heard in a noisy clip.

    Pitch (±4 %), loudness, phase, onset and noise level vary per clip.
    """
    import numpy as np

    options_hz = list(TONES_HZ[: len(_options(cfg, [f"{f:g}Hz" for f in TONES_HZ]))])
    names = [f"{f:g}Hz" for f in options_hz]
    answer = rng.randrange(len(options_hz))
    n = round(cfg.audio_seconds * AUDIO_RATE)
    freq = options_hz[answer] * (1 + rng.uniform(-0.04, 0.04))
    amp, phase = rng.uniform(0.2, 0.6), rng.uniform(0, 2 * np.pi)
    onset = rng.randint(0, n // 4)
    t = np.arange(n - onset) / AUDIO_RATE
    noise = np.random.default_rng(rng.getrandbits(32))
    wave = noise.normal(0, rng.uniform(0.005, 0.03), n).astype(np.float32)
    wave[onset:] += (amp * np.sin(2 * np.pi * freq * t + phase)).astype(np.float32)
    return {
        "prompt": _question("<audio>", "pitch", names),
        "label": string.ascii_uppercase[answer],
        "metadata": {"task": "audio_tones", "choices": names},
        "_media": {"audio": [(np.clip(wave, -1, 1), AUDIO_RATE)]},
        "_key": f"{answer}-{freq:.2f}-{amp:.3f}-{phase:.3f}-{onset}",
    }
