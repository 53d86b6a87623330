"""The slow-tool environment (relax_core/agentic/lookup.py) against its real HTTP service: concurrent
episodes' tool calls overlap, and a service that is down or too slow is a counted tool error, not a
failed episode."""

from __future__ import annotations

import random
import socket

import pytest

from relax_core.agentic import MultiTurnRunner
from relax_core.agentic.lookup import LookupService, lookup_value
from relax_core.agentic.tasks import lookup_row
from relax_core.agentic.warmstart import expert_policy
from relax_core.config.schema import DataConfig
from relax_core.modes.base import reward_metrics
from relax_core.samples import PromptRecord, SampleStatus
from tests.agentic.conftest import rollout_cfg

LOOKUP = "relax_core.agentic.lookup.SlowLookupEnv"


def lookup_prompts(tokenizer, n: int) -> list[PromptRecord]:
    rng, cfg = random.Random(0), DataConfig(min_digits=3, max_digits=3)
    rows = [lookup_row(rng, cfg) for _ in range(n)]
    return [
        PromptRecord(i, tokenizer(r["prompt"]).input_ids, r["prompt"], r["label"], r["metadata"])
        for i, r in enumerate(rows)
    ]


def run_expert(tokenizer, prompts, n: int, **env):
    """``n`` episodes per prompt played by the environment's expert (call, then copy the value)."""
    cfg = rollout_cfg(LOOKUP)
    cfg.env |= env
    return MultiTurnRunner(cfg, tokenizer).run(prompts, n, expert_policy(tokenizer))


def peak_concurrency(events: list[tuple[str, float, float]]) -> int:
    edges = sorted([(start, 1) for _, start, _ in events] + [(end, -1) for _, _, end in events])
    level = peak = 0
    for _, delta in edges:  # an end sorts before a start at the same instant: touching is not overlap
        level += delta
        peak = max(peak, level)
    return peak


@pytest.fixture
def service():
    svc = LookupService(latency_s=0.3)
    yield svc
    svc.close()


def test_concurrent_episodes_tool_calls_overlap(tokenizer, service):
    prompts = lookup_prompts(tokenizer, 4)
    samples = run_expert(tokenizer, prompts, 2, url=service.url, timeout_s=3.0)
    assert [s.reward for s in samples] == [1.0] * 8
    assert all(
        s.reward_extras["tool_calls"] == 1.0 and s.reward_extras["tool_errors"] == 0.0 for s in samples
    )
    assert {p.label for p in prompts} == {lookup_value(p.metadata["key"]) for p in prompts}
    # from the service's (start, end) events: calls in flight at once; run one after another it is 1 (the
    # expected 8 needs every thread started within the 0.3 s latency, which a loaded machine can miss)
    assert len(service.events) == 8
    assert peak_concurrency(service.events) >= 2


def test_service_down_or_slow_is_a_counted_tool_error(tokenizer, service):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    prompts = lookup_prompts(tokenizer, 2)
    down = run_expert(tokenizer, prompts, 2, url=dead)
    # the service answers after 0.3 s, the client waits 0.05 s: a timeout, still within the step limit
    slow = run_expert(tokenizer, prompts, 1, url=service.url, timeout_s=0.05)
    for sample in down + slow:
        assert sample.status == SampleStatus.COMPLETED and sample.stop_reason == "done"
        assert sample.reward == 0.0  # the expert copies the right value, but without a working call
        assert sample.reward_extras["tool_errors"] == 1.0 and sample.reward_extras["env_failed"] == 0.0
        assert "=error" in tokenizer.decode(sample.response_ids)
    assert reward_metrics(down)["reward/tool_errors"] == 1.0
