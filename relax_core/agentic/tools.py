"""Function calling in the model's own text: the chat-template convention of a model family.

Qwen3 (and its VL / Omni variants) write a call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
after any plain text, one block per call; the OpenAI API carries the same call as a ``tool_calls`` entry
with ``arguments`` as a JSON string. :func:`parse_tool_calls` turns the model's text into the API's
message, :func:`assistant_text` the API's message back into the text the model writes (used where no chat
template renders it: the tiny character tokenizer, and warm-start demonstrations).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

_QWEN3_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _arguments_json(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The message content (text outside the call blocks; None when empty) and the OpenAI ``tool_calls``
    of the model's ``text``. A block that is not a JSON object with a string ``name`` stays in the content:
    the program sees what the model wrote, and no call it did not make."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    position = 0
    for match in _QWEN3_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        kept.append(text[position : match.start()])
        position = match.end()
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": call["name"], "arguments": _arguments_json(call.get("arguments", {}))},
            }
        )
    kept.append(text[position:])
    content = "".join(kept).strip() if calls else text
    return content or None, calls


def tool_call_text(name: str, arguments: Any) -> str:
    """One call as the model writes it (compact JSON: fewer tokens for character-level tokenizers; a chat
    template renders calls its own way)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False, separators=(",", ":"))
    return f"<tool_call>{call}</tool_call>"


def assistant_text(message: dict[str, Any]) -> str:
    """An assistant message (content and ``tool_calls``) as the text the model writes for it."""
    text = str(message.get("content") or "")
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        text += tool_call_text(str(function.get("name", "")), function.get("arguments", {}))
    return text


def message_key(message: dict[str, Any]) -> tuple[Any, ...]:
    """What identifies a message when a program sends the conversation back: role, content, and its calls
    (name and arguments, JSON-normalised; the call ids a client may drop or rewrite do not count)."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        arguments = function.get("arguments", "")
        try:
            arguments = (
                json.dumps(json.loads(arguments), sort_keys=True)
                if isinstance(arguments, str)
                else (json.dumps(arguments, sort_keys=True))
            )
        except (TypeError, ValueError):
            arguments = str(arguments)
        calls.append((function.get("name"), arguments))
    return message.get("role"), str(message.get("content") or ""), tuple(calls)
