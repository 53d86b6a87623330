"""Our engine behind its SGLang-compatible HTTP server, the shared HTTP client, the router, and the
SGLang / vLLM adapters (their runtimes need a GPU; what runs without one is tested here)."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from relax_core.config import ModelConfig
from relax_core.engines import build_engine
from relax_core.engines.base import GenerationRequest, SamplingParams
from relax_core.engines.client import HttpEngine, save_weights_folder
from relax_core.engines.http_server import ServerThread, create_app
from relax_core.engines.router import Router
from relax_core.engines.sglang import launch_command, sglang_unavailable_reason
from relax_core.engines.vllm import vllm_unavailable_reason
from relax_core.errors import RelaxUserError
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
    eos, engine.eos_token_ids = engine.eos_token_ids, []  # every sample runs to its budget unless aborted
    try:
        with ThreadPoolExecutor(2) as pool, httpx.Client(base_url=url, timeout=120) as http:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 150}}
            keep = pool.submit(http.post, "/generate", json=body | {"rid": "keep"})
            stop = pool.submit(http.post, "/generate", json=body | {"rid": "stop"})
            while engine.num_running() < 2:
                time.sleep(0.005)
            assert http.post("/abort_request", json={"rid": "stop"}).json()["success"]
            kept, stopped = keep.result().json()["meta_info"], stop.result().json()["meta_info"]
    finally:
        engine.eos_token_ids = eos
    assert (kept["id"], kept["finish_reason"]["type"], kept["completion_tokens"]) == ("keep", "length", 150)
    assert (stopped["id"], stopped["finish_reason"]["type"]) == ("stop", "abort")
    assert stopped["completion_tokens"] < 150


def test_client_matches_in_process_engine_and_updates_weights(
    server, tokenizer, model, tiny_model_dir, tmp_path
) -> None:
    url, engine = server
    client = HttpEngine(url, base_model_path=str(tiny_model_dir))
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
    assert client.health()
    client.shutdown()


def test_concurrent_requests_share_decode_steps(server, tokenizer) -> None:
    """Many HTTP requests at once are batched together by the server's engine loop."""
    url, engine = server
    engine.eos_token_ids = []
    client = HttpEngine(url)
    requests = [GenerationRequest(tokenizer(f"sort {i}:").input_ids, str(i)) for i in range(12)]
    results = client.generate(requests, SamplingParams(max_new_tokens=16, n=2))
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


@pytest.mark.slow
def test_standalone_server_one_command(tiny_model_dir, tokenizer) -> None:
    """``python -m relax_core.engines.http_server --model PATH --port N`` serves /generate."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "relax_core.engines.http_server",
        "--model",
        str(tiny_model_dir),
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(cmd + ["--threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        client = HttpEngine(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 120
        while not client.health():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.5)
        [result] = client.generate([GenerationRequest(tokenizer("sort 5:").input_ids)], SamplingParams(4))
        assert 1 <= len(result.output_ids) <= 4 and len(result.logprobs) == len(result.output_ids)
        client.shutdown()
    finally:
        proc.terminate()
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
