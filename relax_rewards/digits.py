"""Reward of the default synthetic task: reproduce a target digit string."""

from __future__ import annotations

from typing import Any

from relax_rewards.registry import register


@register("digits", key="score", needs_label=True)
def digits_reward(response: str, label: str, metadata: dict[str, Any] | None = None) -> dict[str, float]:
    """Per-position partial credit, so a tiny policy gets a learning signal before it is exactly right.

    score = #{i < len(label): response[i] == label[i]} / max(len(label), len(response)) after stripping
    surrounding whitespace of the response; dividing by the longer length penalises extra characters.
    acc = 1.0 only for an exact match.
    """
    if label is None or not str(label):
        raise ValueError(f"digits reward needs a non-empty target digit string as label, got {label!r}")
    label = str(label)
    response = (response or "").strip()
    hits = sum(1 for a, b in zip(response, label, strict=False) if a == b)
    return {"score": hits / max(len(label), len(response)), "acc": 1.0 if response == label else 0.0}
