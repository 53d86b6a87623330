"""``f1``: SQuAD-style token F1 for short-answer QA."""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any

from relax_rewards._text import strip_think, tag_contents
from relax_rewards.registry import register

# answers that are a decision, not a span: partial overlap with them means nothing
_EXACT_ONLY = {"yes", "no", "noanswer"}
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lower-case, drop punctuation and the articles a/an/the, squeeze whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def token_f1(pred: str, gold: str) -> tuple[float, float, float]:
    """(f1, precision, recall) of normalised tokens."""
    p, g = normalize_answer(pred), normalize_answer(gold)
    if (p in _EXACT_ONLY or g in _EXACT_ONLY) and p != g:
        return 0.0, 0.0, 0.0
    p_tokens, g_tokens = p.split(), g.split()
    if not p_tokens or not g_tokens:  # an empty reference means "no answer": only empty matches it
        same = float(p_tokens == g_tokens)
        return same, same, same
    common = sum((Counter(p_tokens) & Counter(g_tokens)).values())
    if common == 0:
        return 0.0, 0.0, 0.0
    precision, recall = common / len(p_tokens), common / len(g_tokens)
    return 2 * precision * recall / (precision + recall), precision, recall


def extract_short_answer(response: str) -> str:
    """The answer span: the last ``<answer>`` tag, else a trailing ``Answer:`` line, else the text
    after ``</think>``."""
    text = strip_think(response)
    tags = tag_contents(text, "answer")
    if tags:
        return tags[-1].strip()
    m = re.findall(r"(?i)(?:final\s+)?answer\s*(?:is|:)\s*([^\n]+)", text)
    if m:
        return m[-1].strip()
    return text.strip()


@register("f1", key="score", needs_label=True)
def f1_reward(response: str, label: Any, metadata: dict[str, Any] | None = None) -> dict[str, float]:
    """Token F1 against the best of one or more references; yes/no/noanswer must match exactly.

    Returns ``score`` (F1), ``em`` (normalised exact match), ``precision`` and ``recall``.
    """
    golds = label if isinstance(label, list | tuple) else [label]
    golds = [str(g) for g in golds if g is not None]
    if not golds:
        raise ValueError(f"f1 reward needs a reference answer as label, got {label!r}")
    pred = extract_short_answer(response)
    best = max((token_f1(pred, g) for g in golds), key=lambda t: t[0])
    em = float(any(normalize_answer(pred) == normalize_answer(g) for g in golds))
    return {"score": best[0], "em": em, "precision": best[1], "recall": best[2]}
