"""An agent program written the common way, with the ``openai`` SDK's function calling, trained by Relax.

Run by the launcher (``python -m relax_launch experiment=agent_tools_calc``), which sets
``OPENAI_BASE_URL`` (the policy under training) and ``RELAX_EPISODES_URL`` (where episodes come from).
Each episode is a question such as ``7+5`` or ``7*5``. The program offers two functions, ``add(a, b)`` and
``mul(a, b)``, runs the one the model calls and answers with its result: reward 1 for the right answer, so
the model has to pick the function that fits the question and pass it the question's numbers.
``RELAX_AGENT_STREAM=1`` reads every reply as a stream of chunks instead; ``RELAX_AGENT_SESSIONS=4`` plays
four episodes at once, one thread each.
"""

from __future__ import annotations

import json
import os
import threading
import traceback
import urllib.request

from openai import OpenAI

BASE_URL = os.environ["OPENAI_BASE_URL"].rstrip("/")
EPISODES_URL = os.environ.get("RELAX_EPISODES_URL", f"{BASE_URL}/episodes/next")
STREAM = os.environ.get("RELAX_AGENT_STREAM") == "1"
# episodes this copy plays at once, one thread each: the endpoint batches the model calls of every session
SESSIONS = int(os.environ.get("RELAX_AGENT_SESSIONS", "1"))
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
    for name, description in [("add", "a + b"), ("mul", "a * b")]
]
FUNCTIONS = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b}


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as reply:
        return json.loads(reply.read())


def run_call(call: dict) -> str:
    """The result of one of the model's calls: the named function on integer ``a`` and ``b``, else an
    error message the model reads."""
    function = FUNCTIONS.get(call["function"]["name"])
    try:
        arguments = json.loads(call["function"]["arguments"])
        a, b = arguments["a"], arguments["b"]
    except (ValueError, TypeError, KeyError):
        return "error"
    if function is None or not (type(a) is int and type(b) is int):
        return "error"
    return str(function(a, b))


def ask(client: OpenAI, session_id: str, messages: list[dict]) -> dict:
    """The model's next message as a dict: ``content`` and the ``tool_calls`` it made."""
    if not STREAM:
        reply = client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, user=session_id
        )
        message = reply.choices[0].message
        calls = [c.model_dump() for c in message.tool_calls or []]
        return {"role": "assistant", "content": message.content, "tool_calls": calls}
    content, calls = "", {}
    chunks = client.chat.completions.create(
        model="policy", messages=messages, tools=TOOLS, user=session_id, stream=True
    )
    for chunk in chunks:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(
                call.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            entry["id"] = call.id or entry["id"]
            if call.function is not None:
                entry["function"]["name"] += call.function.name or ""
                entry["function"]["arguments"] += call.function.arguments or ""
    return {"role": "assistant", "content": content or None, "tool_calls": [calls[i] for i in sorted(calls)]}


def play(client: OpenAI, episode: dict) -> None:
    """One episode: the model's reply; the program answers with the result of its first call (a reply
    without a call answers nothing). The reward goes back to the trainer."""
    session_id, messages = episode["session_id"], list(episode["messages"])
    calls = ask(client, session_id, messages)["tool_calls"]
    answer = run_call(calls[0]) if calls else ""
    right_tool = bool(calls) and calls[0]["function"]["name"] == episode["metadata"]["tool"]
    correct = answer == str(episode["label"])
    metrics = {"acc": float(correct), "tool_called": float(bool(calls)), "right_tool": float(right_tool)}
    post(f"{BASE_URL}/sessions/{session_id}/reward", {"reward": float(correct), "metrics": metrics})


def play_until_done(client: OpenAI) -> None:
    try:
        while True:
            episode = post(EPISODES_URL, {})
            if episode["done"]:
                return
            play(client, episode)
    except BaseException:
        # one failed session ends the whole copy, as it would with one session: the trainer then fails this
        # copy's episodes and restarts it at once, instead of waiting out the episode timeout
        traceback.print_exc()
        os._exit(1)


def main() -> None:
    client = OpenAI()  # reads OPENAI_BASE_URL and OPENAI_API_KEY; one client serves every thread
    sessions = [threading.Thread(target=play_until_done, args=(client,)) for _ in range(SESSIONS)]
    for session in sessions:
        session.start()
    for session in sessions:
        session.join()


if __name__ == "__main__":
    main()
