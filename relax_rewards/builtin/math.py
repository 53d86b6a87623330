"""``math``: final-answer equivalence for math problems via math-verify."""

from __future__ import annotations

from typing import Any

from relax_rewards._mathverify import answers_equal, gold_list, text_matches
from relax_rewards._text import after_think, last_boxed
from relax_rewards.registry import register


@register("math", needs_label=True)
def math_reward(response: str, label: Any, metadata: dict[str, Any] | None = None) -> float:
    """1.0 when the response's final answer equals the reference, else 0.0.

    The answer is the last ``\\boxed{...}`` (nested braces kept); without one, math-verify looks for it
    in the text after ``</think>`` (or in the whole response when there is no thinking block).
    ``label`` may be a list of acceptable answers. Equivalence covers fractions vs decimals,
    ``\\dfrac``, sets, intervals, tuples, percentages and units.
    """
    golds = gold_list(label, "math")
    boxed = last_boxed(response)
    if boxed is not None:
        return 1.0 if any(answers_equal(boxed, g) for g in golds) else 0.0
    region = after_think(response)
    text = response if region is None else region
    if not text.strip():
        return 0.0
    return 1.0 if any(text_matches(text, g) for g in golds) else 0.0
