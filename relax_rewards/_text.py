"""Text helpers shared by the built-in verifiers: answer regions, boxed answers, tags, numbers."""

from __future__ import annotations

import re

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_THINK_CLOSE = "</think>"


def after_think(text: str) -> str | None:
    """Return the text after the last ``</think>``, or None when the response has no closing tag.

    Reasoning models put their final answer after the thinking block; a response without the closing
    tag was cut off or ignored the format, and callers decide what that means.
    """
    idx = text.rfind(_THINK_CLOSE)
    if idx < 0:
        return None
    return text[idx + len(_THINK_CLOSE) :]


def strip_think(text: str) -> str:
    """The answer region: text after the last ``</think>`` if there is one, else the whole text."""
    region = after_think(text)
    return text if region is None else region


def _balanced_group(text: str, start: int) -> tuple[str, int] | None:
    """Content of the brace group opening at ``text[start] == "{"`` and the index after it."""
    depth = 0
    for i in range(start, len(text)):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
            continue  # an escaped brace \{ or \} is content, not structure
        if ch == "{" and (i == start or text[i - 1] != "\\"):
            depth += 1
        elif ch == "}" and text[i - 1] != "\\":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
    return None


def all_boxed(text: str) -> list[str]:
    """Contents of every complete ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces kept), in order.

    ``\\boxed 5`` (the space form) yields ``5``. A box whose braces never close (a truncated
    response) is skipped.
    """
    found: list[tuple[int, str]] = []
    for cmd in _BOX_COMMANDS:
        for m in re.finditer(re.escape(cmd) + r"(?![A-Za-z])", text):
            j = m.end()
            while j < len(text) and text[j] == " ":
                j += 1
            if j < len(text) and text[j] == "{":
                group = _balanced_group(text, j)
                if group is not None:
                    found.append((m.start(), group[0]))
            elif j > m.end():
                token = re.match(r"[^\s$]+", text[j:])
                if token:
                    found.append((m.start(), token.group(0).rstrip(".,")))
    return [content for _, content in sorted(found)]


def last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` in ``text`` (nested braces kept), or None."""
    boxes = all_boxed(text)
    return boxes[-1] if boxes else None


def tag_contents(text: str, tag: str) -> list[str]:
    """Contents of every ``<tag>...</tag>`` pair (non-greedy, across lines)."""
    return re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL)


_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(,\d{3})+(\.\d+)?$")


def strip_thousands_commas(s: str) -> str:
    """``1,234,567`` -> ``1234567``; anything that is not a comma-grouped number is returned as is."""
    return s.replace(",", "") if _THOUSANDS.match(s) else s


def canonical_number(s: str) -> str:
    """Write a plain decimal the same way every time (``42.0`` -> ``42``, ``0.50`` -> ``0.5``)."""
    if not re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)", s):
        return s
    try:
        value = float(s)
    except ValueError:
        return s
    if value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value)
