"""``openr1mm``: R1-style multimodal reasoning reward: 1.0 for the right answer, else 0.0 (a format bonus
only when ``format_weight`` is configured)."""

from __future__ import annotations

import re
from typing import Any

from relax_rewards._mathverify import answers_equal, gold_list
from relax_rewards._text import after_think, tag_contents
from relax_rewards.registry import register

_FORMAT = re.compile(
    r"^\s*<think>(?:(?!</?think>).)*</think>\s*<answer>(?:(?!</?answer>).)*</answer>\s*$", re.DOTALL
)


def has_r1_format(response: str) -> bool:
    """Exactly one ``<think>...</think>`` followed by exactly one ``<answer>...</answer>``, nothing else."""
    return _FORMAT.match(response) is not None


def _norm_text(s: str) -> str:
    return re.sub(r"\s+", " ", s.strip().strip("$").rstrip(".").strip().lower())


# a response repeating any of these is rejected (score 0): the answer it gives is ambiguous
_SINGLE_TAGS = ("</think>", "<answer>", "</answer>")


@register("openr1mm", key="score", needs_label=True)
def openr1mm_reward(
    response: str, label: Any, metadata: dict[str, Any] | None = None, *, format_weight: float = 0.0
) -> dict[str, float]:
    """``score = acc + format_weight * format`` (``format_weight`` 0 by default: 1.0/0.0), with ``acc`` and
    ``format`` also returned (each 0/1).

    A response with more than one ``</think>``, ``<answer>`` or ``</answer>`` scores 0. The answer is
    the ``<answer>`` tag (else the text after ``</think>``, else the response); accuracy is math
    equivalence with a normalised string comparison as fallback, so both numbers and free-text answers
    (e.g. "a red car") work.
    """
    if any(response.count(tag) > 1 for tag in _SINGLE_TAGS):
        return {"score": 0.0, "acc": 0.0, "format": 0.0}
    # Open-R1 style solutions wrap the reference itself in <answer>...</answer>
    golds = [(tag_contents(g, "answer") or [g])[-1].strip() for g in gold_list(label, "openr1mm")]
    tags = tag_contents(response, "answer")
    if tags:
        answer = tags[-1]
    else:
        region = after_think(response)
        answer = response if region is None else region
    answer = answer.strip()
    acc = 0.0
    if answer:
        for g in golds:
            if _norm_text(answer) == _norm_text(g) or answers_equal(answer, g):
                acc = 1.0
                break
    fmt = 1.0 if has_r1_format(response) else 0.0
    return {"score": acc + format_weight * fmt, "acc": acc, "format": fmt}
