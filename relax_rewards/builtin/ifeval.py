"""``ifeval``: verifiable instruction following (IFEval-style instruction ids and kwargs).

``metadata["instruction_id_list"]`` names the instructions a response must follow and
``metadata["kwargs"]`` (a list aligned with it, entries may be None/{} and None values are ignored)
gives their parameters. Supported instructions:

====================================================  ==============================================
id                                                    kwargs / rule
====================================================  ==============================================
length_constraints:number_words                       relation, num_words
length_constraints:number_sentences                   relation, num_sentences
length_constraints:number_paragraphs                  num_paragraphs (exactly; split on ``***`` lines,
                                                      else on blank lines)
keywords:existence                                    keywords: all appear (case-insensitive words)
keywords:forbidden_words                              forbidden_words: none appears
keywords:frequency                                    keyword, relation, frequency
detectable_format:json_format                         whole response (``` fences allowed) is JSON
detectable_format:number_bullet_lists                 num_bullets: exactly that many ``*``/``-`` lines
detectable_format:number_highlighted_sections         num_highlights: at least that many ``*text*``
detectable_format:title                               a ``<<title>>`` is present
detectable_content:number_placeholders                num_placeholders: at least that many ``[name]``
detectable_content:postscript                         postscript_marker (default "P.S.") starts a line
change_case:english_lowercase                         no upper-case letters
change_case:english_capital                           no lower-case letters
change_case:capital_word_frequency                    capital_relation, capital_frequency (ALL-CAPS words)
startend:start_checker                                start_phrase: response starts with it
startend:end_checker                                  end_phrase: response ends with it
startend:quotation                                    response is wrapped in double quotes
punctuation:no_comma                                  no commas
====================================================  ==============================================

``relation`` is one of "less than", "at most", "exactly", "at least", "more than". The reward is
``{"score": 1.0 if every instruction passes else 0.0, "partial": fraction passed}``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from relax_rewards._text import strip_think
from relax_rewards.registry import register

_RELATIONS: dict[str, Callable[[int, int], bool]] = {
    "less than": lambda n, k: n < k,
    "at most": lambda n, k: n <= k,
    "exactly": lambda n, k: n == k,
    "at least": lambda n, k: n >= k,
    "more than": lambda n, k: n > k,
}


def _compare(count: int, relation: str | None, target: Any, what: str) -> bool:
    rel = (relation or "at least").strip().lower()
    if rel not in _RELATIONS:
        raise ValueError(f"ifeval {what}: unknown relation {relation!r}; use one of {sorted(_RELATIONS)}")
    return _RELATIONS[rel](count, int(target))


def _words(text: str) -> list[str]:
    return re.findall(r"\b\w+(?:['’]\w+)*\b", text)


def _sentences(text: str) -> list[str]:
    parts = re.split(r"(?<=[.!?])\s+", text.strip())
    return [p for p in parts if re.search(r"\w", p)]


def _paragraphs(text: str) -> list[str]:
    if re.search(r"^\s*\*\*\*\s*$", text, flags=re.MULTILINE):
        parts = re.split(r"^\s*\*\*\*\s*$", text, flags=re.MULTILINE)
    else:
        parts = re.split(r"\n\s*\n", text)
    return [p for p in parts if p.strip()]


def _count_word(text: str, word: str) -> int:
    return len(re.findall(rf"(?<!\w){re.escape(word)}(?!\w)", text, flags=re.IGNORECASE))


def _is_json(text: str) -> bool:
    s = text.strip()
    s = re.sub(r"^```(?:json|JSON)?\s*", "", s)
    s = re.sub(r"\s*```$", "", s)
    try:
        json.loads(s)
    except ValueError:
        return False
    return True


def _need(kw: dict[str, Any], name: str, iid: str) -> Any:
    if kw.get(name) is None:
        raise ValueError(f"ifeval instruction {iid!r} needs kwarg {name!r}")
    return kw[name]


def _check(iid: str, text: str, kw: dict[str, Any]) -> bool:
    if iid == "length_constraints:number_words":
        return _compare(len(_words(text)), kw.get("relation"), _need(kw, "num_words", iid), iid)
    if iid == "length_constraints:number_sentences":
        return _compare(len(_sentences(text)), kw.get("relation"), _need(kw, "num_sentences", iid), iid)
    if iid == "length_constraints:number_paragraphs":
        return len(_paragraphs(text)) == int(_need(kw, "num_paragraphs", iid))
    if iid == "keywords:existence":
        return all(_count_word(text, k) > 0 for k in _need(kw, "keywords", iid))
    if iid == "keywords:forbidden_words":
        return not any(_count_word(text, k) > 0 for k in _need(kw, "forbidden_words", iid))
    if iid == "keywords:frequency":
        count = _count_word(text, _need(kw, "keyword", iid))
        return _compare(count, kw.get("relation"), _need(kw, "frequency", iid), iid)
    if iid == "detectable_format:json_format":
        return _is_json(text)
    if iid == "detectable_format:number_bullet_lists":
        bullets = re.findall(r"^\s*[*-]\s+\S", text, flags=re.MULTILINE)
        return len(bullets) == int(_need(kw, "num_bullets", iid))
    if iid == "detectable_format:number_highlighted_sections":
        highlights = [h for h in re.findall(r"\*+([^*\n]+)\*+", text) if h.strip()]
        return len(highlights) >= int(_need(kw, "num_highlights", iid))
    if iid == "detectable_format:title":
        return any(t.strip() for t in re.findall(r"<<([^\n]+?)>>", text))
    if iid == "detectable_content:number_placeholders":
        return len(re.findall(r"\[[^\[\]\n]+\]", text)) >= int(_need(kw, "num_placeholders", iid))
    if iid == "detectable_content:postscript":
        marker = kw.get("postscript_marker") or "P.S."
        return re.search(rf"^\s*{re.escape(marker)}", text, flags=re.MULTILINE | re.IGNORECASE) is not None
    if iid == "change_case:english_lowercase":
        return text == text.lower() and re.search(r"[a-z]", text) is not None
    if iid == "change_case:english_capital":
        return text == text.upper() and re.search(r"[A-Z]", text) is not None
    if iid == "change_case:capital_word_frequency":
        caps = [w for w in _words(text) if len(w) > 1 and w.isupper()]
        return _compare(len(caps), kw.get("capital_relation"), _need(kw, "capital_frequency", iid), iid)
    if iid == "startend:start_checker":
        return text.strip().lower().startswith(str(_need(kw, "start_phrase", iid)).strip().lower())
    if iid == "startend:end_checker":
        return text.strip().lower().endswith(str(_need(kw, "end_phrase", iid)).strip().lower())
    if iid == "startend:quotation":
        s = text.strip()
        return len(s) > 1 and s[0] == '"' and s[-1] == '"'
    if iid == "punctuation:no_comma":
        return "," not in text
    raise ValueError(f"ifeval: unsupported instruction id {iid!r}; supported: {', '.join(SUPPORTED)}")


SUPPORTED = (
    "length_constraints:number_words",
    "length_constraints:number_sentences",
    "length_constraints:number_paragraphs",
    "keywords:existence",
    "keywords:forbidden_words",
    "keywords:frequency",
    "detectable_format:json_format",
    "detectable_format:number_bullet_lists",
    "detectable_format:number_highlighted_sections",
    "detectable_format:title",
    "detectable_content:number_placeholders",
    "detectable_content:postscript",
    "change_case:english_lowercase",
    "change_case:english_capital",
    "change_case:capital_word_frequency",
    "startend:start_checker",
    "startend:end_checker",
    "startend:quotation",
    "punctuation:no_comma",
)


def check_instructions(
    response: str, instruction_ids: list[str], kwargs_list: list[Any] | None
) -> list[bool]:
    """Pass/fail of each instruction on the answer region of ``response``."""
    kwargs_list = list(kwargs_list) if kwargs_list is not None else [{}] * len(instruction_ids)
    if len(kwargs_list) != len(instruction_ids):
        raise ValueError(
            f"ifeval: {len(instruction_ids)} instruction ids but {len(kwargs_list)} kwargs entries"
        )
    text = strip_think(response).strip()
    results = []
    for iid, kw in zip(instruction_ids, kwargs_list, strict=True):
        clean = {k: v for k, v in (kw or {}).items() if v is not None}
        results.append(_check(iid, text, clean))
    return results


@register("ifeval", key="score")
def ifeval_reward(
    response: str, label: Any = None, metadata: dict[str, Any] | None = None
) -> dict[str, float]:
    """All-or-nothing ``score`` plus the ``partial`` fraction of instructions followed.

    Instructions come from ``metadata`` (``instruction_id_list`` + ``kwargs``); a dict label with the
    same keys is accepted too, for datasets that store them as the label.
    """
    source = metadata if metadata and "instruction_id_list" in metadata else label
    if not isinstance(source, dict) or not source.get("instruction_id_list"):
        raise ValueError(
            "ifeval reward needs metadata['instruction_id_list'] (and optional metadata['kwargs'])"
        )
    passed = check_instructions(response, list(source["instruction_id_list"]), source.get("kwargs"))
    frac = sum(passed) / len(passed)
    return {"score": 1.0 if all(passed) else 0.0, "partial": frac}
