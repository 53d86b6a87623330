"""``dapo`` and ``dapo_strict_box``: exact-match math rewards in the DAPO style (+1 / -1).

The policy is prompted to end with ``Answer: X``; both sides are normalised the Minerva way (units,
``\\text{}``, ``$``, thousands commas, ``x = 42`` -> ``42``) and compared as strings. The returned dict
holds ``score`` (1.0 or -1.0), ``acc`` (1.0 or 0.0) and ``pred`` (the normalised prediction, a string:
the executor keeps only numeric entries as extras, so ``pred`` is for direct callers and debugging).
"""

from __future__ import annotations

import re
from typing import Any

from relax_rewards._mathverify import gold_list
from relax_rewards._text import canonical_number, last_boxed, strip_thousands_commas
from relax_rewards.registry import register

# the answer is looked for only near the end, where the prompt asks for it
TAIL_CHARS = 300

_UNIT_WORDS = (
    "square units|square feet|square inches|square meters|square centimeters|square cm|sq ft|units|unit|"
    "cm|km|mm|meters|meter|metres|metre|m|inches|inch|feet|foot|ft|yards|yard|miles|mile|mph|"
    "hours|hour|minutes|minute|seconds|second|sec|days|day|weeks|week|years|year|"
    "dollars|dollar|cents|cent|degrees|degree|pounds|pound|lbs|kg|grams|gram|g|liters|liter|ml|"
    "students|people|points|ways|times|percent"
)
_UNITS_AT_END = re.compile(rf"(?<=[\d}}])\s*(?:\\(?:text|mbox|mathrm)\{{\s*)?(?:{_UNIT_WORDS})\.?\}}?$")
_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox|boxed)\{([^{}]*)\}")


def normalize_final_answer(answer: str) -> str:
    """Canonical string form of a final answer, so formatting differences do not count as errors."""
    s = answer.strip()
    s = s.split("=")[-1]  # "x = 42" -> "42"
    for _ in range(3):  # nested wrappers like \text{\textbf{5}}
        s = _WRAPPERS.sub(r"\1", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\left", "").replace("\\right", "")
    s = re.sub(r"\\[,;:! ]", "", s)
    s = s.replace("\\%", "").replace("%", "").replace("^\\circ", "").replace("^{\\circ}", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.strip().rstrip(".").strip()
    s = _UNITS_AT_END.sub("", s).strip()
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)  # \frac12 -> \frac{1}{2}
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d+)", r"\\sqrt{\1}", s)
    s = strip_thousands_commas(s.replace(" ", ""))
    return canonical_number(s)


def extract_answer_line(response: str) -> str | None:
    """The text after the last ``Answer:`` in the response tail, up to the end of its line."""
    matches = re.findall(r"(?i)answer\s*:\s*([^\n]*)", response[-TAIL_CHARS:])
    if not matches:
        return None
    ans = matches[-1].strip()
    return ans or None


def _outcome(pred: str | None, label: Any, name: str) -> dict[str, Any]:
    golds = {normalize_final_answer(g) for g in gold_list(label, name)}
    norm = normalize_final_answer(pred) if pred is not None else ""
    correct = bool(norm) and norm in golds
    return {"score": 1.0 if correct else -1.0, "acc": 1.0 if correct else 0.0, "pred": norm}


@register("dapo", key="score", needs_label=True)
def dapo_reward(response: str, label: Any, metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """+1 when the normalised ``Answer: X`` from the response tail equals the normalised label, else -1."""
    return _outcome(extract_answer_line(response), label, "dapo")


@register("dapo_strict_box", key="score", needs_label=True)
def dapo_strict_box_reward(
    response: str, label: Any, metadata: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Like ``dapo`` but the answer must be the last ``\\boxed{}`` in the response tail; none -> -1."""
    return _outcome(last_boxed(response[-TAIL_CHARS:]), label, "dapo_strict_box")
