"""Function calling and streaming on the OpenAI-compatible endpoint, driven by the real ``openai`` SDK over
real HTTP. The engine replies with scripted turns (a random-init model does not write call blocks; the
launch test in test_agent_program.py trains one that does), so the assertions can name exact calls."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI

from relax_core.agentic.programs import mask_runs
from relax_core.agentic.server import AgentServer, TrajectoryStore, build_app
from relax_core.agentic.tools import assistant_text, parse_tool_calls
from relax_core.engines.base import GenerationRequest, GenerationResult, SamplingParams

CALL = '<tool_call>{"name":"calc","arguments":{"expr":"7+5"}}</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an integer expression.",
            "parameters": {
                "type": "object",
                "properties": {"expr": {"type": "string"}},
                "required": ["expr"],
            },
        },
    }
]


class ScriptedEngine:
    """Replies with the next scripted text (plus EOS) to every request, as a rollout engine would."""

    def __init__(self, tokenizer, turns: list[str]) -> None:
        self.tokenizer, self.turns = tokenizer, list(turns)

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[GenerationResult]:
        out = []
        for r in requests:
            ids = self.tokenizer(self.turns.pop(0), add_special_tokens=False).input_ids
            ids.append(self.tokenizer.eos_token_id)
            out.append(GenerationResult(ids, [-0.5] * len(ids), "stop", r.request_id, 0))
        return out


@pytest.fixture
def serve(tokenizer):
    servers = []

    def start(turns: list[str]) -> tuple[str, TrajectoryStore]:
        store = TrajectoryStore()
        app = build_app(ScriptedEngine(tokenizer, turns), tokenizer, SamplingParams(max_new_tokens=80), store)
        servers.append(AgentServer(app).start())
        return servers[-1].url, store

    yield start
    for server in servers:
        server.stop()


def test_tool_calls_parse_in_the_family_convention():
    content, calls = parse_tool_calls("let me add " + CALL)
    assert content == "let me add"
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "calc", {"expr": "7+5"})
    ]
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert parse_tool_calls("12") == ("12", [])
    assert assistant_text({"content": None, "tool_calls": calls}) == CALL


def test_function_calling_with_the_openai_sdk_records_masked_turns(serve, tokenizer):
    url, store = serve([CALL, "12"])
    client = OpenAI(base_url=f"{url}/v1", api_key="relax")
    messages = [{"role": "user", "content": "7+5"}]
    first = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, user="s1")
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "calc" and json.loads(call.function.arguments) == {"expr": "7+5"}
    # the program sends the SDK's message object back, then the tool's result
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "12"},
    ]
    second = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, user="s1")
    assert second.choices[0].message.content == "12" and second.choices[0].finish_reason == "stop"
    assert not second.choices[0].message.tool_calls
    httpx.post(f"{url}/v1/sessions/s1/reward", json={"reward": 1.0}).raise_for_status()
    (sample,) = store.pop_finished()
    assert sample.metadata["restarts"] == 0, "the tool call round-tripped through the SDK unchanged"
    assert mask_runs(tokenizer, sample.response_ids, sample.loss_mask) == [
        {"mask": 1, "text": CALL + "<eos>"},  # the model's call: trained
        {"mask": 0, "text": "12\n"},  # the tool's result: not trained
        {"mask": 1, "text": "12<eos>"},
    ]
    assert sample.rollout_logprobs == [-0.5 if m else 0.0 for m in sample.loss_mask]


def test_streaming_with_the_openai_sdk(serve):
    url, store = serve(["hello there", CALL])
    client = OpenAI(base_url=f"{url}/v1", api_key="relax")
    chunks = list(
        client.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": "hi"}],
            user="s2",
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "hello there" and sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len("hello there") + 1
    # a streamed call arrives as a tool_calls delta; the raw stream ends with [DONE]
    body = {"messages": [{"role": "user", "content": "7+5"}], "tools": TOOLS, "stream": True, "user": "s3"}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in reply.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    deltas = [e["choices"][0]["delta"] for e in events]
    (calls,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert calls[0]["index"] == 0 and calls[0]["function"]["name"] == "calc"
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_choice_none_keeps_calls_as_text_forced_calls_and_bad_requests_are_refused(serve):
    url, _ = serve([CALL])
    with httpx.Client(base_url=url, timeout=30) as http:
        body = {"messages": [{"role": "user", "content": "7+5"}], "tools": TOOLS, "tool_choice": "none"}
        plain = http.post("/v1/chat/completions", json=body, headers={"X-Session-Id": "s4"}).json()
        assert plain["choices"][0]["message"] == {"role": "assistant", "content": CALL}
        for forced in ["required", {"type": "function", "function": {"name": "calc"}}]:
            reply = http.post(
                "/v1/chat/completions", json=body | {"tool_choice": forced}, headers={"X-Session-Id": "s6"}
            )
            assert reply.status_code == 400 and "not supported" in reply.json()["detail"], forced
        for bad in [
            {"tools": [{"type": "function"}]},
            {"tools": TOOLS, "tool_choice": "sometimes"},
            {"messages": [{"role": "robot", "content": "x"}]},
            {"temperature": "hot"},
        ]:
            reply = http.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "x"}]} | bad,
                headers={"X-Session-Id": "s5"},
            )
            assert reply.status_code == 422 and reply.json()["detail"], bad
