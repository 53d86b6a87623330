"""Schema-driven HTTP fuzzing (schemathesis) of every HTTP surface: the engine server, the agent endpoint and
the control plane, each served by uvicorn on 127.0.0.1 from its own OpenAPI schema.

Valid (positive) and malformed (negative) requests are generated per operation; every answer must be a
2xx, or a 4xx whose JSON ``detail`` says what is wrong: never a 5xx, never silence. Then the surface must
still work. The number of cases is bounded (``CASES_PER_MODE`` per operation and mode) and printed. Each
generated JSON body is also sent again with its numbers swapped for values at the edge of the float and
integer range (``EDGES``: NaN, Infinity, 1e308, denormals, -0.0, 2**64), which JSON parsers accept.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from engine_helpers import make_engine
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from selection import selected
from tiers import heavy

from relax_core.agentic.server import AgentServer, TrajectoryStore, build_app
from relax_core.engines.base import SamplingParams
from relax_core.engines.http_server import ServerThread
from relax_core.engines.http_server import create_app as engine_app
from relax_core.rollout.control_plane import create_app as control_plane_app

CASES_PER_MODE = 25
EDGES = [float("nan"), float("inf"), -float("inf"), 1e308, -1e308, 5e-324, -0.0, 2**64, -(2**63) - 1, 2**1000]


def with_edges(value, seed: int):
    """``value`` with every number (bools kept) replaced by an edge value, chosen by position and ``seed``."""
    if isinstance(value, dict):
        return {k: with_edges(v, seed + i) for i, (k, v) in enumerate(value.items())}
    if isinstance(value, list):
        return [with_edges(v, seed + i) for i, v in enumerate(value)]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return EDGES[seed % len(EDGES)]
    return value


def fuzz(
    url: str, modes=("positive", "negative"), skip: tuple[str, ...] = (), after=None
) -> tuple[int, list]:
    """Run the generated cases of every operation of ``url``'s schema; (cases run, bad answers)."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    count, bad = 0, []
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path in skip:
            continue
        # a request with nothing in it (GET /health) cannot be malformed
        has_inputs = bool(list(operation.iter_parameters()) or operation.get_request_payload_content_types())
        for mode in modes if has_inputs else ("positive",):
            strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))

            @settings(
                max_examples=CASES_PER_MODE,
                deadline=None,
                database=None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(case=strategy)
            def run(case) -> None:
                nonlocal count
                bodies = [case.body]
                if isinstance(case.body, (dict, list)):
                    bodies.append(with_edges(case.body, count))
                for body in bodies:
                    count += 1
                    if body is case.body:
                        response = case.call(base_url=url, timeout=60)
                    else:  # sent as text: the client's JSON encoder refuses NaN and Infinity
                        response = httpx.request(
                            case.method,
                            f"{url}{case.formatted_path}",
                            params=case.query,
                            content=json.dumps(body),
                            headers={"content-type": "application/json"},
                            timeout=60,
                        )
                    detail = None
                    try:
                        detail = response.json().get("detail")
                    except (ValueError, AttributeError):
                        pass
                    if response.status_code >= 500 or (response.status_code >= 400 and not detail):
                        bad.append((case.method, case.path, body, response.status_code, response.text[:200]))
                    if after is not None:
                        after()

            try:
                run()
            except Unsatisfiable:  # nothing in this operation can be malformed (e.g. a free-form path id)
                pass
    return count, bad


@pytest.fixture(scope="module")
def counts():
    seen: dict[str, int] = {}
    yield seen
    print(f"\nHTTP fuzz cases run: {seen} (total {sum(seen.values())})")


def test_engine_server_answers_every_generated_request(tiny_model_dir, tokenizer, tmp_path, counts):
    engine = make_engine(tiny_model_dir, tokenizer, seed=3, max_running=16)
    app = engine_app(engine, tokenizer, str(tiny_model_dir), weights_dirs=[str(tmp_path)])
    server = ServerThread(app)
    try:
        # a pause would hold later /generate calls until someone resumes: the fuzzer resumes after each case
        count, bad = fuzz(server.url, after=lambda: httpx.post(f"{server.url}/continue_generation"))
        counts["engine server"] = count
        assert not bad, bad[:5]
        reply = httpx.post(f"{server.url}/generate", json={"text": "sort 21:"}, timeout=60)
        assert reply.status_code == 200 and reply.json()["meta_info"]["completion_tokens"] > 0
    finally:
        server.stop()
        app.state.loop.stop()


def test_agent_endpoint_answers_every_generated_request(tiny_model_dir, tokenizer, counts):
    engine = make_engine(tiny_model_dir, tokenizer, seed=3)
    store = TrajectoryStore()
    app = build_app(engine, tokenizer, SamplingParams(max_new_tokens=8), store, max_context_len=256)
    with AgentServer(app) as server:
        count, bad = fuzz(server.url)
        counts["agent endpoint"] = count
        assert not bad, bad[:5]
        reply = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "user": "after-fuzz"},
            timeout=60,
        )
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["role"] == "assistant"


def test_agent_endpoint_refuses_a_temperature_that_would_overflow(tiny_model_dir, tokenizer):
    app = build_app(
        make_engine(tiny_model_dir, tokenizer, seed=3), tokenizer, SamplingParams(), TrajectoryStore()
    )
    with AgentServer(app) as server:
        body = {"messages": [{"role": "user", "content": "hi"}], "user": "t", "temperature": 5e-324}
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 422 and "temperature" in reply.text, reply.text


def test_control_plane_answers_every_generated_request(counts):
    server = ServerThread(control_plane_app(lambda: None, lambda: {"step": 1}))
    try:
        count, bad = fuzz(server.url)
        counts["control plane"] = count
        assert not bad, bad[:5]
        assert httpx.get(f"{server.url}/health").json()["step"] == 1
    finally:
        server.stop()


FUZZED_RUN_TEST = "test_a_training_run_keeps_training_while_its_endpoints_are_fuzzed"


@pytest.fixture(scope="module")
@heavy("launches `python -m relax_launch`")
def training_run(tmp_path_factory) -> Iterator[tuple[subprocess.Popen, Path]]:
    """A real run (agent program, control plane on), long, stopped by its test: (process, run dir)."""
    root = Path(__file__).resolve().parents[2]
    run_dir = tmp_path_factory.mktemp("fuzzed_run")
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "relax_launch",
            f"hydra.run.dir={run_dir}",
            "logger=jsonl",
            "experiment=agent_program_calc",
            f"rollout.agent.command=[{sys.executable},{root / 'examples' / 'agents' / 'calc_agent.py'}]",
            "control_plane.enabled=true",
            "trainer.total_steps=100000",
            "trainer.sft_warmup_steps=0",
            "trainer.eval_every=0",
            "rollout.batch_size=4",
            "rollout.n_samples_per_prompt=4",
            "rollout.agent.num_workers=4",
            "data.num_eval=4",
        ],
        cwd=run_dir,
        env={**os.environ, "PYTHONPATH": str(root)},
        stdout=subprocess.DEVNULL,
        stderr=open(run_dir / "job.log", "w"),  # noqa: SIM115
    )
    try:
        yield job, run_dir
    finally:
        job.kill()
        job.wait()


@pytest.fixture(scope="module", autouse=True)
def _start_training_run_first(request) -> None:
    """The run starts (Ray, its roles) before the in-process fuzzing, which holds one core, not two."""
    if selected(request, FUZZED_RUN_TEST):
        request.getfixturevalue("training_run")


@pytest.mark.slow
def test_a_training_run_keeps_training_while_its_endpoints_are_fuzzed(training_run, counts):
    """A real run (agent program, control plane on): malformed requests to its control plane and agent
    endpoint get 4xx while it trains, and it keeps training afterwards. Only malformed bodies are sent:
    valid ones would really scale the run or take its episodes. The run is long and stopped with Ctrl-C
    once it has trained past the fuzzing, so its endpoints cannot close under the fuzzer."""
    job, run_dir = training_run

    def steps() -> list[int]:
        path = run_dir / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.is_file() else []
        return [r["step"] for r in map(json.loads, lines[:-1]) if "reward/mean" in r]  # last may be partial

    files = [run_dir / "control_plane.json", run_dir / "agent_logs" / "endpoint.json"]
    deadline = time.monotonic() + 600
    while not all(f.is_file() for f in files):
        assert job.poll() is None, (run_dir / "job.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the run's endpoints did not come up"
        time.sleep(0.5)
    control, agent = (json.loads(f.read_text())["url"] for f in files)
    for name, url, skip in [
        ("live control plane", control, ()),
        ("live agent endpoint", agent, ("/v1/episodes/next",)),
    ]:
        count, bad = fuzz(url, modes=("negative",), skip=skip)
        counts[name] = count
        assert not bad, bad[:5]
    fuzzed_at = max(steps(), default=0)
    deadline = time.monotonic() + 600
    while max(steps(), default=0) < fuzzed_at + 2:  # it trains on after the fuzzing
        assert job.poll() is None, (run_dir / "job.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no step after the fuzzing"
        time.sleep(0.5)
    job.send_signal(signal.SIGINT)
    job.wait(timeout=300)
    done = steps()
    assert done == list(range(1, len(done) + 1)) and len(done) >= fuzzed_at + 2, done
