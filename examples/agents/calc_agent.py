"""An external agent program trained by Relax: tool-use arithmetic over the OpenAI chat API.

Run by the launcher (``python -m relax_launch experiment=agent_program_calc``), which sets
``OPENAI_BASE_URL`` (the policy under training) and ``RELAX_EPISODES_URL`` (where episodes come from).
Each episode is a question such as ``37+45``. The model may call the calculator by answering
``calc(37+45)``; the program replies with a tool message ``=82``; any other answer is final. Reward 1 for
the right final answer given after a calculator call. Only the standard library is needed; with the
``openai`` package installed (and RELAX_AGENT_CLIENT unset or ``openai``) the calls go through it instead.
``RELAX_AGENT_SESSIONS=16`` plays sixteen episodes at once, one thread each.
"""

from __future__ import annotations

import json
import os
import re
import threading
import traceback
import urllib.request

BASE_URL = os.environ["OPENAI_BASE_URL"].rstrip("/")
EPISODES_URL = os.environ.get("RELAX_EPISODES_URL", f"{BASE_URL}/episodes/next")
MAX_TURNS = 3
# episodes this copy plays at once, one thread each: the endpoint batches the model calls of every session
SESSIONS = int(os.environ.get("RELAX_AGENT_SESSIONS", "1"))
CALL = re.compile(r"^calc\(([0-9+\-*]{1,32})\)$")
TERM = re.compile(r"^\d+([+\-*]\d+)*$")


def post(url: str, body: dict, headers: dict | None = None) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(request) as reply:
        return json.loads(reply.read())


def chat_urllib(session_id: str, messages: list[dict]) -> str:
    body = post(
        f"{BASE_URL}/chat/completions",
        {"model": "policy", "messages": messages},
        {"X-Session-Id": session_id},
    )
    return body["choices"][0]["message"]["content"]


def openai_chat():
    """``chat(session_id, messages)`` through the openai package, or None when it is not installed."""
    if os.environ.get("RELAX_AGENT_CLIENT", "openai") != "openai":
        return None
    try:
        from openai import OpenAI
    except ImportError:
        return None
    client = OpenAI()  # reads OPENAI_BASE_URL and OPENAI_API_KEY

    def chat(session_id: str, messages: list[dict]) -> str:
        reply = client.chat.completions.create(model="policy", messages=messages, user=session_id)
        return reply.choices[0].message.content or ""

    return chat


def calculate(expr: str) -> str:
    """``a op b op c`` with +, -, * and the usual precedence (no eval of model text)."""
    if not TERM.match(expr):
        return "error"
    total = 0
    for term in re.findall(r"[+-]?[^+-]+", expr):
        product = 1
        for factor in term.lstrip("+-").split("*"):
            product *= int(factor)
        total += -product if term.startswith("-") else product
    return str(total)


def play(episode: dict, chat) -> None:
    """One episode: up to MAX_TURNS model turns, then the reward goes back to the trainer."""
    session_id, messages = episode["session_id"], list(episode["messages"])
    tool_calls, correct = 0, False
    for _ in range(MAX_TURNS):
        answer = chat(session_id, messages).strip()
        messages.append({"role": "assistant", "content": answer})
        call = CALL.match(answer)
        if call is None:  # the final answer
            correct = tool_calls > 0 and answer == str(episode["label"])
            break
        tool_calls += 1
        messages.append({"role": "tool", "content": f"={calculate(call.group(1))}"})
    metrics = {"acc": float(correct), "tool_called": float(tool_calls > 0)}
    post(f"{BASE_URL}/sessions/{session_id}/reward", {"reward": float(correct), "metrics": metrics})


def play_until_done(chat) -> None:
    try:
        while True:
            episode = post(EPISODES_URL, {})
            if episode["done"]:
                return
            play(episode, chat)
    except BaseException:
        # one failed session ends the whole copy, as it would with one session: the trainer then fails this
        # copy's episodes and restarts it at once, instead of waiting out the episode timeout
        traceback.print_exc()
        os._exit(1)


def main() -> None:
    chat = openai_chat() or chat_urllib
    sessions = [threading.Thread(target=play_until_done, args=(chat,)) for _ in range(SESSIONS)]
    for session in sessions:
        session.start()
    for session in sessions:
        session.join()


if __name__ == "__main__":
    main()
