"""``deepscaler``: strict reasoning-format math reward (boxed answer after the thinking block)."""

from __future__ import annotations

from typing import Any

from relax_rewards._mathverify import answers_equal, gold_list
from relax_rewards._text import after_think, last_boxed
from relax_rewards.registry import register


@register("deepscaler", needs_label=True)
def deepscaler_reward(response: str, label: Any, metadata: dict[str, Any] | None = None) -> float:
    """1.0 only if the response closes ``</think>``, boxes an answer after it, and that answer is right.

    Stricter than ``math``: an unfinished thinking block or an unboxed answer scores 0, which teaches
    the format along with correctness.
    """
    golds = gold_list(label, "deepscaler")
    region = after_think(response)
    if region is None:
        return 0.0
    boxed = last_boxed(region)
    if boxed is None:
        return 0.0
    return 1.0 if any(answers_equal(boxed, g) for g in golds) else 0.0
