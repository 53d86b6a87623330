"""``gpqa``: four-option multiple choice (GPQA-style, letters A-D)."""

from __future__ import annotations

from typing import Any

from relax_rewards.builtin.multiple_choice import score_choice, valid_letters
from relax_rewards.registry import register


@register("gpqa", needs_label=True)
def gpqa_reward(response: str, label: Any, metadata: dict[str, Any] | None = None) -> float:
    """1.0 when the chosen letter equals the label; GPQA has four options, so letters default to A-D.

    The label may be the letter or the correct option's text when ``metadata["choices"]`` lists the
    options in their shuffled order.
    """
    return score_choice(response, label, metadata, valid_letters(metadata, default="ABCD"))
