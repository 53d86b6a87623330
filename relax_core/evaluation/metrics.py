"""Evaluation estimators: pass@k, maj@k, mean reward and response-length statistics.

Pure functions over plain numbers and strings (no engines, no config), so every formula is checked against
hand-computed cases in tests/eval/.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from relax_rewards._text import canonical_number, last_boxed, strip_think, strip_thousands_commas


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct: 1 − C(n−c, k) / C(n, k).

    Computed as the product 1 − Π_{i=n−c+1}^{n} (1 − k/i), which never forms the binomials (they overflow
    floats for n in the hundreds)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def answer_key(response: str, kind: str) -> str | None:
    """The answer a response gives, normalised so that equal answers compare equal (None: no answer).

    ``text``: the response after any think block, whitespace collapsed; ``boxed``: the last \\boxed{...}
    (numbers canonical); ``number``: the last number in the response, canonical."""
    text = strip_think(response)
    if kind == "text":
        answer = " ".join(text.split())
    elif kind == "boxed":
        boxed = last_boxed(text)
        answer = canonical_number(boxed.strip()) if boxed is not None else ""
    elif kind == "number":
        numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
        answer = canonical_number(strip_thousands_commas(numbers[-1])) if numbers else ""
    else:
        raise ValueError(f"unknown answer kind {kind!r} (text, boxed, number)")
    return answer or None


def majority_correct(answers: Sequence[str | None], correct: Sequence[bool]) -> float:
    """1.0 when the most frequent answer is a correct one. Ties go to the answer seen first; responses
    without an answer do not vote (none at all: 0.0)."""
    counts: dict[str, int] = {}
    first_correct: dict[str, bool] = {}
    for answer, ok in zip(answers, correct, strict=True):
        if answer is None:
            continue
        counts[answer] = counts.get(answer, 0) + 1
        first_correct.setdefault(answer, bool(ok))
    if not counts:
        return 0.0
    winner = max(counts, key=lambda a: counts[a])  # max keeps the first of equal counts: insertion order
    return float(first_correct[winner])


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> float:
    """maj@k of one prompt's n samples: the majority vote's correctness averaged over the ⌊n/k⌋ disjoint
    blocks of k samples in sample order (deterministic, every sample used once when k divides n)."""
    n = len(answers)
    if not 0 < k <= n:
        raise ValueError(f"maj@k needs 0 < k <= n, got n={n}, k={k}")
    blocks = [range(b, b + k) for b in range(0, n - k + 1, k)]
    return sum(majority_correct([answers[i] for i in b], [correct[i] for i in b]) for b in blocks) / len(
        blocks
    )


def length_stats(lengths: Sequence[int], prefix: str) -> dict[str, float]:
    """``<prefix>/mean|min|max`` of response lengths in tokens (empty when there are none)."""
    if not lengths:
        return {}
    return {
        f"{prefix}/mean": sum(lengths) / len(lengths),
        f"{prefix}/min": float(min(lengths)),
        f"{prefix}/max": float(max(lengths)),
    }


def sampled_metrics(
    groups: Sequence[tuple[Sequence[bool], Sequence[float], Sequence[str | None]]], ks: Sequence[int]
) -> dict[str, float]:
    """pass@k and maj@k (k ≤ n) averaged over prompts, plus the mean reward, from per-prompt groups of
    (correct, reward, answer) over the same n samples each."""
    if not groups:
        return {}
    n = len(groups[0][0])
    out: dict[str, float] = {}
    for k in sorted({k for k in ks if 0 < k <= n}):
        out[f"pass@{k}"] = sum(pass_at_k(n, sum(map(bool, ok)), k) for ok, _, _ in groups) / len(groups)
        out[f"maj@{k}"] = sum(maj_at_k(ans, ok, k) for ok, _, ans in groups) / len(groups)
    rewards = [r for _, rs, _ in groups for r in rs]
    out["sampled_reward"] = sum(rewards) / len(rewards)
    return out
