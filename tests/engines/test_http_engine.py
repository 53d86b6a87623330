"""Our engine behind its SGLang-compatible HTTP server, the shared HTTP client, the router, and the
SGLang / vLLM adapters (their runtimes need a GPU; what runs without one is tested here)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from engine_helpers import make_engine
from selection import selected
from tiers import heavy

from relax_core.config.schema import ModelConfig
from relax_core.engines import build_engine
from relax_core.engines.base import GenerationRequest, SamplingParams
from relax_core.engines.client import HttpEngine
from relax_core.engines.http_server import ServerLimits, ServerThread, create_app
from relax_core.engines.router import Router
from relax_core.engines.sglang import launch_command, sglang_unavailable_reason
from relax_core.engines.vllm import vllm_unavailable_reason
from relax_core.errors import RelaxUserError
from relax_core.weight_transfer.disk import save_weights_folder
from relax_models.ports import free_port


def test_generate_speaks_sglang_native_api(server, tokenizer) -> None:
    url, _ = server
    ids = tokenizer("sort 321:").input_ids
    with httpx.Client(base_url=url, timeout=60) as http:
        assert http.get("/health").json() == {"status": "ok"}
        one = http.post(
            "/generate",
            json={
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 5, "temperature": 0},
                "return_logprob": True,
            },
        ).json()
        assert set(one) == {"text", "output_ids", "meta_info"}
        meta = one["meta_info"]
        assert meta["finish_reason"]["type"] in ("stop", "length")
        assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == len(one["output_ids"])
        assert [p[1] for p in meta["output_token_logprobs"]] == one["output_ids"]
        assert all(p[0] <= 0 for p in meta["output_token_logprobs"])
        assert one["text"] == tokenizer.decode(one["output_ids"], skip_special_tokens=True)
        many = http.post(
            "/generate", json={"text": "sort 9:", "sampling_params": {"max_new_tokens": 4, "n": 3}}
        ).json()
        assert isinstance(many, list) and len(many) == 3
        batch = http.post(
            "/generate", json={"input_ids": [ids, ids[:3]], "sampling_params": {"max_new_tokens": 2}}
        ).json()
        assert len(batch) == 2
        bad = http.post("/generate", json={"input_ids": ids, "sampling_params": {"top_p": 2}})
        assert bad.status_code == 422 and "top_p" in bad.text
        assert http.post("/generate", json={}).status_code == 400
        assert http.post("/flush_cache").json()["success"]
        assert http.post("/pause_generation", json={"mode": "in_place"}).json()["success"]
        assert http.post("/continue_generation").json()["success"]
        assert http.post("/abort_request", json={"abort_all": True}).json()["success"]
        missing = http.post("/abort_request", json={})
        assert missing.status_code == 400 and "rid" in missing.text


def test_abort_request_by_rid_over_http(server, tokenizer) -> None:
    url, engine = server
    ids = tokenizer("sort 5:").input_ids
    with ThreadPoolExecutor(2) as pool, httpx.Client(base_url=url, timeout=120) as http:
        # every sample runs to its budget unless aborted
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 150, "ignore_eos": True}}
        keep = pool.submit(http.post, "/generate", json=body | {"rid": "keep"})
        stop = pool.submit(http.post, "/generate", json=body | {"rid": "stop"})
        while engine.num_running() < 2:
            time.sleep(0.005)
        assert http.post("/abort_request", json={"rid": "stop"}).json()["success"]
        kept, stopped = keep.result().json()["meta_info"], stop.result().json()["meta_info"]
    assert (kept["id"], kept["finish_reason"]["type"], kept["completion_tokens"]) == ("keep", "length", 150)
    assert (stopped["id"], stopped["finish_reason"]["type"]) == ("stop", "abort")
    assert stopped["completion_tokens"] < 150


def test_client_matches_in_process_engine_and_updates_weights(
    tokenizer, model, tiny_model_dir, tmp_path
) -> None:
    engine = make_engine(tiny_model_dir, tokenizer, seed=3)
    srv = ServerThread(create_app(engine, tokenizer, weights_dirs=[str(tmp_path)]))
    url = srv.url
    client = HttpEngine(url, base_model_path=str(tiny_model_dir), weights_dir=str(tmp_path))
    requests = [GenerationRequest(tokenizer(p).input_ids, p) for p in ["sort 12:", "sort 9876:", "ab"]]
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, n=2)
    remote = client.generate(requests, greedy)
    local = engine.generate(requests, greedy)
    assert [r.output_ids for r in remote] == [r.output_ids for r in local]
    for a, b in zip(remote, local):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)
        assert a.request_id == b.request_id
    # weights through /update_weights_from_disk: outputs and version change
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = torch.randn_like(state["lm_head.weight"])
    client.update_weights(state, version=3)
    assert engine.weight_version == 3
    after = client.generate(requests[:1], SamplingParams(max_new_tokens=6, temperature=0.0))
    assert after[0].weight_version == 3 and after[0].logprobs != remote[0].logprobs
    folder = save_weights_folder(state, str(tiny_model_dir), tmp_path / "w")
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    bad = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(tmp_path / "nothing")})
    assert bad.status_code == 400
    # names and shapes are checked: an unknown tensor or a wrong shape is refused, nothing is loaded
    for name, change in [
        ("extra", {"not.a.weight": torch.zeros(2)}),
        ("shape", {"lm_head.weight": torch.zeros(3, 3)}),
    ]:
        folder = save_weights_folder(state | change, None, tmp_path / name)
        refused = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(folder)})
        assert refused.status_code == 400 and ("does not have" in refused.text or "shape" in refused.text)
    partial = save_weights_folder({"lm_head.weight": state["lm_head.weight"]}, None, tmp_path / "partial")
    refused = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(partial)})
    assert refused.status_code == 400 and "missing" in refused.text
    assert engine.weight_version == 3
    # only the allowed folders load
    outside = save_weights_folder(state, None, tmp_path.parent / f"{tmp_path.name}-outside")
    refused = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(outside)})
    assert refused.status_code == 403 and "outside" in refused.text
    odd = httpx.post(
        f"{url}/update_weights_from_disk", json={"model_path": str(folder), "weight_version": "x"}
    )
    assert odd.status_code == 422 and "weight_version" in odd.text
    assert client.health()
    client.shutdown()
    srv.stop()


def test_every_request_is_answered_with_a_reason(server, tokenizer, tiny_model_dir) -> None:
    url, engine = server
    ids = tokenizer("sort 5:").input_ids
    context = engine.model.config.max_position_embeddings

    def generate(http: httpx.Client, body: dict) -> httpx.Response:
        return http.post("/generate", json={"sampling_params": {"max_new_tokens": 2}} | body)

    with httpx.Client(base_url=url, timeout=60) as http:
        for bad_ids in ([999999], [-5], [[1, 2], [3, 10**9]]):
            reply = generate(http, {"input_ids": bad_ids})
            assert reply.status_code == 400 and "outside the vocabulary" in reply.text, reply.text
        huge = generate(http, {"input_ids": ids, "sampling_params": {"max_new_tokens": 100000}})
        assert huge.status_code == 400 and f"context of {context}" in huge.text
        many = generate(http, {"input_ids": ids, "sampling_params": {"n": engine.max_running + 1}})
        assert many.status_code == 400 and "--max-running" in many.text
        rids = generate(http, {"text": ["a", "b"], "rid": ["only-one"]})
        assert rids.status_code == 400 and "rid has 1 entries for 2 prompts" in rids.text
        assert http.post("/pause_generation", json={"mode": "sideways"}).status_code == 422
        assert generate(http, {"input_ids": ids}).status_code == 200
        assert engine.cache_bytes() > 0
        # SGLang's release/resume endpoints (rollout.release_memory_during_train on an external engine)
        assert http.post("/release_memory_occupation", json={"tags": ["kv_cache"]}).json()["success"]
        assert engine.cache_bytes() == 0
        assert http.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).json()["success"]
        assert generate(http, {"input_ids": ids}).status_code == 200 and engine.cache_bytes() > 0

    # a job that fails inside the engine (no limits: the bad id reaches the model) answers with its error
    bare = make_engine(tiny_model_dir, tokenizer, seed=3)
    srv = ServerThread(create_app(bare, tokenizer, limits=ServerLimits()))
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        failed = generate(http, {"input_ids": [999999]})
        assert failed.status_code == 500 and "IndexError" in failed.text
        assert generate(http, {"input_ids": ids}).status_code == 200  # and the engine serves on
    srv.stop()


def test_kv_cache_stays_within_its_budget(tiny_model_dir, tokenizer) -> None:
    engine = make_engine(tiny_model_dir, tokenizer, seed=3)
    limits = ServerLimits.of(engine, kv_cache_gb=0)
    one_request = 4 * 40 * limits.kv_bytes_per_token  # n=4 samples of 40 positions
    limits.kv_budget_bytes = one_request
    srv = ServerThread(create_app(engine, tokenizer, limits=limits))
    ids = tokenizer("sort 12345:").input_ids
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        over = http.post(
            "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 40, "n": 4}}
        )
        assert over.status_code == 400 and "--kv-cache-gb" in over.text
        fits = {"input_ids": ids, "sampling_params": {"max_new_tokens": 40 - len(ids), "n": 4}}
        assert http.post("/generate", json=fits).status_code == 200
    # the engine rounds its cache up (8 slots, 64 positions): once idle, the excess is given back
    deadline = time.monotonic() + 30
    while engine.cache_bytes() > limits.kv_budget_bytes:
        assert time.monotonic() < deadline, engine.cache_bytes()
        time.sleep(0.05)
    srv.stop()


def server_command(model_dir, *args: str) -> list[str]:
    return [sys.executable, "-m", "relax_core.engines.http_server", "--model", str(model_dir), *args]


@pytest.fixture(scope="module")
@heavy("launches the engine server")
def refused_starts(tiny_model_dir) -> dict[str, subprocess.CompletedProcess]:
    """The standalone server refusing two setups; both started at once, as each is mostly Python start-up
    (torch, the app) on one core."""
    env = {k: v for k, v in os.environ.items() if k != "RELAX_ENGINE_TOKEN"}
    commands = {
        "exposed": server_command(tiny_model_dir, "--host", "0.0.0.0"),
        "fp16 kernels": server_command(tiny_model_dir, "--native-kernels", "--dtype", "float16"),
    }
    procs = {
        name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for name, cmd in commands.items()
    }
    done = {}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=120)
            done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
    return done


def test_token_guards_every_endpoint(tiny_model_dir, tokenizer, refused_starts) -> None:
    engine = make_engine(tiny_model_dir, tokenizer, seed=3)
    srv = ServerThread(create_app(engine, tokenizer, token="s3cret"))
    assert httpx.get(f"{srv.url}/health").status_code == 401
    assert httpx.post(f"{srv.url}/update_weights_from_disk", json={"model_path": "/"}).status_code == 401
    assert httpx.get(f"{srv.url}/health", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    srv.stop()
    exposed = refused_starts["exposed"]
    assert exposed.returncode == 1
    assert exposed.stderr.strip().splitlines()[-1] == (
        "error: --host='0.0.0.0' is reachable from other machines: set --token (or RELAX_ENGINE_TOKEN)"
    )


def test_server_refuses_native_kernels_in_a_dtype_they_do_not_run(refused_starts) -> None:
    refused = refused_starts["fp16 kernels"]
    assert refused.returncode == 1
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rollout.native_kernels=true runs the fp32 or bf16 CPU decode"), last
    assert "torch.float16" in last


def test_concurrent_requests_share_decode_steps(server, tokenizer) -> None:
    """Many HTTP requests at once are batched together by the server's engine loop."""
    url, engine = server
    client = HttpEngine(url)
    requests = [GenerationRequest(tokenizer(f"sort {i}:").input_ids, str(i)) for i in range(12)]
    results = client.generate(requests, SamplingParams(max_new_tokens=16, n=2, ignore_eos=True))
    assert len(results) == 24 and all(len(r.output_ids) == 16 for r in results)
    assert engine.peak_running > 2
    client.shutdown()


def test_router_least_outstanding_groups_and_health(tiny_model_dir, tokenizer) -> None:
    router = Router()
    for key in ("a", "b"):
        router.add(key)
    # groups stay whole and go to the least loaded engine
    assert router.assign([8, 8, 8]) == ["a", "b", "a"]
    router.release("a", 16)
    assert router.assign([8]) == ["a"]
    router.set_draining("b")
    assert router.assign([1, 1]) == ["a", "a"]
    router.set_draining("b", False)
    # real servers: one goes down -> dropped; back on the same port -> routed to again
    engines = [build_engine("torch", str(tiny_model_dir), tokenizer, ModelConfig(), seed=1) for _ in range(2)]
    servers = [ServerThread(create_app(e, tokenizer)) for e in engines]
    clients = {key: HttpEngine(s.url) for key, s in zip("ab", servers)}
    probe = lambda key: clients[key].health()  # noqa: E731
    assert router.check_health(probe) == {"a": True, "b": True}
    port = servers[1].port
    servers[1].stop()
    assert router.check_health(probe) == {"a": True, "b": False}
    assert router.keys(routable_only=True) == ["a"]
    assert router.assign([4, 4]) == ["a", "a"]
    servers[1] = ServerThread(create_app(engines[1], tokenizer), port=port)
    assert router.check_health(probe)["b"] is True
    assert "b" in router.keys(routable_only=True)
    for s in servers:
        s.stop()
    router.mark_unhealthy("a")
    router.mark_unhealthy("b")
    with pytest.raises(RuntimeError, match="no healthy"):
        router.assign([1])


STANDALONE = {"eager": [], "native": ["--native-kernels", "--dtype", "bfloat16"]}


@pytest.fixture(scope="module")
@heavy("launches the engine server")
def standalone_servers(request, tiny_model_dir) -> Iterator[dict[str, tuple[int, subprocess.Popen]]]:
    """The selected ``STANDALONE`` servers (port, process), all started at once: each start is mostly
    Python start-up on one core."""
    wanted = {item.callspec.id for item in selected(request, "test_standalone_server_one_command")}
    servers = {}
    try:
        for name in STANDALONE.keys() & wanted:
            port = free_port()
            cmd = server_command(tiny_model_dir, "--port", str(port), "--threads", "1", *STANDALONE[name])
            servers[name] = port, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        yield servers
    finally:
        for _, proc in servers.values():
            proc.kill()
            proc.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(STANDALONE))
def test_standalone_server_one_command(standalone_servers, tokenizer, engine: str) -> None:
    """``python -m relax_core.engines.http_server --model PATH --port N`` serves /generate, on the eager step
    or on the fused kernels in bf16."""
    port, proc = standalone_servers[engine]
    try:
        client = HttpEngine(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 120
        while not client.health():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.5)
        [result] = client.generate([GenerationRequest(tokenizer("sort 5:").input_ids)], SamplingParams(4))
        assert 1 <= len(result.output_ids) <= 4 and len(result.logprobs) == len(result.output_ids)
        # a request stuck in a paused engine does not keep SIGTERM from stopping the server
        client.pause()
        stuck: dict = {}
        waiter = threading.Thread(
            target=lambda: stuck.update(
                reply=client.generate([GenerationRequest([5, 6], "stuck")], SamplingParams(4))
            )
        )
        waiter.start()
        while client.http.get("/get_model_info").json()["num_running"] < 1:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        # uvicorn re-raises the signal once it has shut down; the stuck request was answered first
        assert proc.wait(timeout=60) == -signal.SIGTERM
        waiter.join(timeout=60)
        assert stuck["reply"][0].finish_reason == "abort"
        client.shutdown()
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_sglang_and_vllm_adapters_without_their_runtimes(tokenizer, tiny_model_dir) -> None:
    cmd = launch_command("/m", 1234)
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and cmd[cmd.index("--port") + 1] == "1234"
    for name, reason in (("sglang", sglang_unavailable_reason()), ("vllm", vllm_unavailable_reason())):
        if reason is None:
            continue
        with pytest.raises(RelaxUserError, match=f"rollout.engine={name}"):
            build_engine(name, str(tiny_model_dir), tokenizer, ModelConfig(), seed=0)
    with pytest.raises(RelaxUserError, match="not available"):
        build_engine("nope", str(tiny_model_dir), tokenizer, ModelConfig(), seed=0)


@pytest.mark.gpu
@pytest.mark.skipif(sglang_unavailable_reason() is not None, reason=str(sglang_unavailable_reason()))
def test_sglang_engine_generates_on_gpu(tiny_model_dir, tokenizer) -> None:
    engine = build_engine("sglang", str(tiny_model_dir), tokenizer, ModelConfig(), seed=0)
    try:
        results = engine.generate([GenerationRequest(tokenizer("sort 5:").input_ids)], SamplingParams(4, n=2))
        assert len(results) == 2 and all(len(r.logprobs) == len(r.output_ids) for r in results)
    finally:
        engine.shutdown()
