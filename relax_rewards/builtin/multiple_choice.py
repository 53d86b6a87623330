"""``multiple_choice``: letter answers (A, B, C, ...) found in free-form responses."""

from __future__ import annotations

import functools
import re
import string
from typing import Any

from relax_rewards._text import strip_think
from relax_rewards.registry import register

DEFAULT_LETTERS = "ABCD"


def valid_letters(metadata: dict[str, Any] | None, default: str = DEFAULT_LETTERS) -> str:
    """Allowed letters: ``metadata["valid_letters"]`` ("ABCDE" or a list), else one per entry of
    ``metadata["choices"]`` (a list of options or their count), else ``default``."""
    md = metadata or {}
    if md.get("valid_letters"):
        letters = "".join(str(x).strip().upper() for x in md["valid_letters"])
    elif md.get("choices") is not None:
        choices = md["choices"]
        n = choices if isinstance(choices, int) else len(choices)
        if not 1 <= n <= 26:
            raise ValueError(f"metadata['choices'] must give 1..26 options, got {n}")
        letters = string.ascii_uppercase[:n]
    else:
        letters = default
    if not letters or not all(ch in string.ascii_uppercase for ch in letters):
        raise ValueError(f"valid letters must be A-Z, got {letters!r}")
    return letters


@functools.lru_cache(maxsize=64)
def _patterns(letters: str) -> list[re.Pattern[str]]:
    L = f"[{letters}]"
    # a letter standing alone: not part of a longer word ("A" in "Actually" does not count)
    end = r"(?![A-Za-z0-9])"
    return [
        re.compile(rf"<answer>\s*\(?({L}){end}\)?[^<]*</answer>", re.DOTALL),
        re.compile(rf"\\boxed\{{\s*(?:\\text\{{)?\s*\(?({L}){end}"),
        re.compile(
            rf"(?i:final\s+answer)\s*(?:is|:)?\s*[:\-]?\s*\**\s*(?:(?i:option|choice)\s+)?\(?({L}){end}"
        ),
        re.compile(
            rf"(?i:answer)\s*(?:(?i:is)|:)\s*\**\s*(?:(?i:option|choice)\s+)?\(?({L}){end}",
        ),
        re.compile(rf"(?i:(?:option|choice))\s+\(?({L}){end}\)?\s*(?i:is\s+(?:correct|right))"),
        re.compile(rf"\(({L})\)"),
        re.compile(rf"^\s*\**\(?({L})[\).:]?\**\s*$"),
    ]


def extract_choice(response: str, letters: str = DEFAULT_LETTERS) -> str | None:
    """The chosen letter: the strongest cue wins (answer tag, box, "final answer", "answer is",
    "(X)", a bare letter), and within one cue the last occurrence."""
    text = strip_think(response)
    for pattern in _patterns(letters):
        matches = pattern.findall(text)
        if matches:
            return matches[-1]
    return None


def label_letter(label: Any, letters: str, metadata: dict[str, Any] | None = None) -> str:
    """The correct letter from a label that is a letter ("B", "(B)"), a 0-based index, or the text of
    one of ``metadata["choices"]``."""
    if isinstance(label, bool) or label is None:
        raise ValueError(f"multiple-choice label must be a letter, an index or a choice text, got {label!r}")
    if isinstance(label, int):
        if not 0 <= label < len(letters):
            raise ValueError(f"multiple-choice label index {label} is out of range for letters {letters!r}")
        return letters[label]
    text = str(label).strip()
    m = re.fullmatch(r"\(?([A-Za-z])\)?\.?", text)
    if m and m.group(1).upper() in letters:
        return m.group(1).upper()
    choices = (metadata or {}).get("choices")
    if isinstance(choices, list | tuple):
        for i, choice in enumerate(choices):
            if str(choice).strip() == text and i < len(letters):
                return letters[i]
    raise ValueError(
        f"multiple-choice label {label!r} is not one of the letters {letters!r} or a listed choice"
    )


def score_choice(response: str, label: Any, metadata: dict[str, Any] | None, letters: str) -> float:
    gold = label_letter(label, letters, metadata)
    return 1.0 if extract_choice(response, letters) == gold else 0.0


@register("multiple_choice", needs_label=True)
def multiple_choice_reward(response: str, label: Any, metadata: dict[str, Any] | None = None) -> float:
    """1.0 when the letter the response commits to equals the label, else 0.0 (letters from metadata)."""
    return score_choice(response, label, metadata, valid_letters(metadata))
