"""``remote`` and ``genrm`` against a real HTTP server on 127.0.0.1, and genrm with a callable judge."""

from __future__ import annotations

import re
import time

import pytest

import relax_rewards
from relax_rewards.builtin.genrm import DEFAULT_TEMPLATE
from relax_rewards.executor import RewardExecutor, RewardItem

remote = relax_rewards.get("remote")
genrm = relax_rewards.get("genrm")


def test_remote_posts_prompt_response_label_and_reads_reward(http_server) -> None:
    http_server.handler = lambda body: (200, {"reward": 0.75})
    out = remote("print(1)", {"tests": 3}, {"prompt": "write code"}, url=http_server.url + "/score")
    assert out == 0.75
    req = http_server.requests[0]
    assert req["path"] == "/score"
    assert req["body"] == {"prompt": "write code", "response": "print(1)", "label": {"tests": 3}}


def test_remote_retries_after_a_failing_first_response(http_server) -> None:
    replies = iter([(503, {"error": "busy"}), (200, {"reward": 1.0, "passed": 3, "total": 3})])
    http_server.handler = lambda body: next(replies)
    t0 = time.monotonic()
    out = remote("x", "y", url=http_server.url, retries=2, backoff_s=0.2)
    assert out == {"reward": 1.0, "passed": 3.0, "total": 3.0}
    assert len(http_server.requests) == 2
    assert time.monotonic() - t0 >= 0.2  # it backed off before retrying


def test_remote_gives_up_with_a_clear_error(http_server) -> None:
    http_server.handler = lambda body: (500, {"error": "down"})
    with pytest.raises(RuntimeError, match="failed after 3 attempts; last error: HTTP 500"):
        remote("x", "y", url=http_server.url, retries=2, backoff_s=0.01)
    assert len(http_server.requests) == 3
    http_server.handler = lambda body: (400, {"error": "bad label"})
    with pytest.raises(RuntimeError, match="rejected the request: HTTP 400"):
        remote("x", "y", url=http_server.url, retries=5, backoff_s=0.01)
    assert len(http_server.requests) == 4  # a client error is not retried
    with pytest.raises(ValueError, match="needs a url"):
        remote("x", "y")


def test_remote_through_the_executor_uses_the_reward_key(http_server) -> None:
    http_server.handler = lambda body: (
        200,
        {"reward": float(body["response"] == body["label"]), "latency_ms": 5},
    )
    cfg = {"name": "remote", "kwargs": {"url": http_server.url, "backoff_s": 0.01}, "timeout_s": 5}
    with RewardExecutor.from_config(cfg) as ex:
        outs = ex.score([RewardItem("a", "42", "42"), RewardItem("b", "41", "42")])
    assert [(o.reward, o.extras) for o in outs] == [(1.0, {"latency_ms": 5.0}), (0.0, {"latency_ms": 5.0})]


class ReferenceJudge:
    """A small but real judge: reads the filled template and compares the two answers numerically."""

    def __init__(self) -> None:
        self.prompts: list[str] = []

    def generate_text(self, prompt: str) -> str:
        self.prompts.append(prompt)
        ref = re.search(r"Reference answer:\n(.*?)\n\n", prompt, re.DOTALL).group(1)
        ans = re.search(r"Model answer:\n(.*?)\n\n", prompt, re.DOTALL).group(1)
        nums = re.findall(r"-?\d+(?:\.\d+)?", ans)
        return " 1\n" if nums and float(nums[-1]) == float(ref) else "0"


def test_genrm_with_a_callable_judge() -> None:
    judge = ReferenceJudge()
    md = {"question": "How many legs do 3 spiders have?"}
    assert genrm("<think>8 legs each, 3*8</think> They have 24 legs.", "24", md, judge=judge)["score"] == 1.0
    assert genrm("They have 21 legs.", "24", md, judge=judge)["score"] == 0.0
    prompt = judge.prompts[0]
    assert "How many legs do 3 spiders have?" in prompt and "They have 24 legs." in prompt
    assert "8 legs each" not in prompt  # the thinking block is not shown to the judge
    # a plain function works as a judge too; by default only a reply that is one digit has a verdict
    verdict = {"score": 1.0, "judge_parse_errors": 0.0, "judge_errors": 0.0}
    assert genrm("x", "y", judge=lambda p: "1") == verdict
    assert genrm("x", "y", judge=lambda p: "0") == verdict | {"score": 0.0}
    garbage = verdict | {"score": 0.0, "judge_parse_errors": 1.0}
    assert genrm("x", "y", judge=lambda p: "1.") == garbage
    assert genrm("x", "y", judge=lambda p: "Yes, 1") == garbage
    # verdict parsing is config
    assert (
        genrm(
            "x",
            "y",
            judge=lambda p: "Verdict: CORRECT.",
            verdict_pattern=r"Verdict: (\w+)",
            correct_verdict="CORRECT",
        )
        == verdict
    )
    with pytest.raises(ValueError, match="needs a judge"):
        genrm("x", "y")


def test_genrm_via_sglang_generate_endpoint(http_server) -> None:
    def sglang(body: dict) -> tuple[int, dict]:
        verdict = "1" if "Model answer:\nParis" in body["text"] else "0"
        return 200, {"text": verdict, "meta_info": {"completion_tokens": 1}}

    http_server.handler = sglang
    md = {"question": "Capital of France?"}
    assert genrm("Paris", "Paris", md, url=http_server.url)["score"] == 1.0
    assert genrm("Lyon", "Paris", md, url=http_server.url)["score"] == 0.0
    req = http_server.requests[0]
    assert req["path"] == "/generate"
    assert req["body"]["sampling_params"]["temperature"] == 0.0
    assert req["body"]["text"] == DEFAULT_TEMPLATE.format(
        question="Capital of France?", reference="Paris", response="Paris"
    )
