"""Mathematical answer equivalence on top of the math-verify package.

math-verify parses LaTeX / plain expressions into SymPy and compares them (fractions vs decimals,
``\\dfrac``, sets, intervals, tuples, equations like ``x = 5``). This module adds what it leaves to the
caller: cleaning of extracted answers (plain-word units, ``\\%``, thousands commas), percent-aware
comparison, a cache for reference answers (a group of samples shares one), and the timeout choice —
math-verify's own timeouts use ``signal.alarm`` and only work on the main thread, so off the main
thread they are disabled and the executor's per-call timeout is the guard.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from collections.abc import Iterable
from fractions import Fraction
from typing import Any

from relax_rewards._text import strip_thousands_commas

_MV_TIMEOUT_S = 5

_PCT = re.compile(r"\s*(\\%|%|\\text\{\s*percent\s*\}|\s+percent)\s*$")
# a number followed by plain words ("18 dollars", "5 square feet") -> the number
_TRAILING_WORDS = re.compile(r"^(.*?\d)\s+(?:[A-Za-z]{2,}\.?)(?:\s+[A-Za-z]+\.?)*$")
_TEXT_UNIT = re.compile(r"^(.*?\d)\s*(?:\\(?:text|mbox|mathrm)\{\s*[A-Za-z][A-Za-z .]*\})+$")


def _drop_timeout_notices(record: logging.LogRecord) -> bool:
    # math-verify warns once that its timeout is off (off the main thread that is our choice, and the
    # executor's per-call timeout still applies) and logs every pathological answer that timed out
    # ("Timeout during parsing: <answer>"); the answer already scores 0, so both lines are only noise
    return not str(record.msg).startswith(("Timeout is disabled", "Timeout during"))


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_drop_timeout_notices)


def _timeout() -> int | None:
    return _MV_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _configs() -> list[Any]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]


def clean_answer(ans: str) -> tuple[str, bool]:
    """Tidy an extracted answer; return it and whether it was written as a percentage."""
    s = ans.strip().strip("$").strip()
    s = re.sub(r"^\\text\{\s*(.*?)\s*\}$", r"\1", s)
    s = s.rstrip(".").strip()
    is_pct = False
    m = _PCT.search(s)
    if m:
        s, is_pct = s[: m.start()].strip(), True
    for pattern in (_TEXT_UNIT, _TRAILING_WORDS):
        m = pattern.match(s)
        if m:
            s = m.group(1)
    s = s.replace("^\\circ", "").replace("^{\\circ}", "")
    return strip_thousands_commas(s.strip()), is_pct


def _parse(s: str) -> list[Any]:
    from math_verify import parse

    return parse("\\boxed{" + s + "}", _configs(), parsing_timeout=_timeout())


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> tuple[list[Any], bool]:
    cleaned, is_pct = clean_answer(gold)
    return _parse(cleaned), is_pct


def _verify(gold: list[Any], pred: list[Any]) -> bool:
    from math_verify import verify

    return bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=_timeout())


def _hundredth(parsed: list[Any]) -> list[Any]:
    """Numeric entries of a parse result divided by 100 (``50\\%`` read as ``0.5``)."""
    import sympy

    return [p / 100 for p in parsed if isinstance(p, sympy.Expr) and p.is_number]


def _norm_str(s: str) -> str:
    return (
        re.sub(r"\s+|\\[,;:! ]|\\left|\\right", "", s)
        .replace("\\dfrac", "\\frac")
        .replace("\\tfrac", "\\frac")
    )


_INT_OR_DEC = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_SLASH = re.compile(r"([+-]?\d+)\s*/\s*(\d+)")
_FRAC = re.compile(r"([+-]?)\\[dt]?frac(?:\{\s*(\d+)\s*\}|(\d))(?:\{\s*(\d+)\s*\}|(\d))")


def as_number(s: str) -> Fraction | None:
    """The exact value of a plain number (``-12``, ``0.25``, ``3/4``, ``\\frac{3}{4}``), else None.

    Most answers are such numbers; deciding them here skips math-verify's LaTeX parser, which costs
    tens of milliseconds per new expression.
    """
    s = s.strip()
    try:
        if _INT_OR_DEC.fullmatch(s):
            return Fraction(s)
        m = _SLASH.fullmatch(s)
        if m and int(m.group(2)) != 0:
            return Fraction(int(m.group(1)), int(m.group(2)))
        m = _FRAC.fullmatch(s)
        if m:
            num, den = int(m.group(2) or m.group(3)), int(m.group(4) or m.group(5))
            if den != 0:
                return Fraction(-num if m.group(1) == "-" else num, den)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _numbers_equal(p: str, p_pct: bool, g: str, g_pct: bool) -> bool | None:
    """Decide equality of two plain numbers exactly; None when math-verify must decide (not both
    plain numbers, or unequal decimals that its rounding tolerance might still accept)."""
    pn, gn = as_number(p), as_number(g)
    if pn is None or gn is None:
        return None
    preds = [pn] + ([pn / 100] if p_pct and not g_pct else [])
    golds = [gn] + ([gn / 100] if g_pct and not p_pct else [])
    if any(a == b for a in preds for b in golds):
        return True
    if "." in p or "." in g:
        return None
    return False


def answers_equal(pred: str, gold: str) -> bool:
    """True when an extracted answer ``pred`` equals the reference ``gold`` mathematically.

    Percentages count both ways: ``50\\%`` matches ``50`` and ``0.5``.
    """
    p_clean, p_pct = clean_answer(pred)
    g_clean, g_pct = clean_answer(gold)
    if not p_clean:
        return False
    if _norm_str(p_clean) == _norm_str(g_clean):
        return True
    decided = _numbers_equal(p_clean, p_pct, g_clean, g_pct)
    if decided is not None:
        return decided
    gold_parsed, _ = _parse_gold(gold)
    pred_parsed = _parse(p_clean)
    if _verify(gold_parsed, pred_parsed):
        return True
    if p_pct and not g_pct and _verify(gold_parsed, _hundredth(pred_parsed)):
        return True
    if g_pct and not p_pct and _verify(_hundredth(gold_parsed), pred_parsed):
        return True
    return False


def text_matches(text: str, gold: str) -> bool:
    """Let math-verify find the answer in free text (no ``\\boxed``) and compare it with ``gold``."""
    from math_verify import parse

    pred_parsed = parse(text, _configs(), parsing_timeout=_timeout())
    gold_parsed, _ = _parse_gold(gold)
    return _verify(gold_parsed, pred_parsed)


def gold_list(label: Any, reward: str) -> list[str]:
    """Reference answers as strings: one label, or a list/tuple of acceptable ones."""
    if label is None:
        raise ValueError(f"{reward} reward needs a label (the reference answer), got None")
    labels: Iterable[Any] = label if isinstance(label, list | tuple) else [label]
    golds = [str(g).strip() for g in labels if g is not None and str(g).strip()]
    if not golds:
        raise ValueError(f"{reward} reward needs a non-empty reference answer, got {label!r}")
    return golds
