"""Hostile requests to the engine server (issue 45): float-edge and out-of-range numbers, oversized bodies,
tens of thousands of stop strings, the schema without a token, and weight folders that lie (symlinks out,
FIFOs, corrupt or truncated files, NaN or wrong-dtype tensors). Each gets a 4xx naming its cause; other
requests are unaffected and the old weights keep serving."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import httpx
import torch
from engine_helpers import make_engine

from relax_core.engines.http_server import ServerLimits, ServerThread, create_app
from relax_core.weight_transfer.disk import save_weights_folder

GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def _raw(http: httpx.Client, path: str, body: str) -> httpx.Response:
    """POST a JSON text as is (NaN and Infinity are what Python's and JS's encoders write)."""
    return http.post(path, content=body, headers={"content-type": "application/json"})


def test_edge_numbers_and_limits_get_4xx_and_spare_other_requests(tiny_model_dir, tokenizer) -> None:
    engine = make_engine(tiny_model_dir, tokenizer, seed=3)
    limits = ServerLimits.of(engine, kv_cache_gb=1)
    limits.max_body_bytes = 2**20
    srv = ServerThread(create_app(engine, tokenizer, limits=limits))
    long_reply: list[httpx.Response] = []
    # a request decoding meanwhile: none of the bad ones below may fail it
    busy = {"text": "sort 1:", "sampling_params": {"max_new_tokens": 120, "ignore_eos": True}}
    worker = threading.Thread(
        target=lambda: long_reply.append(httpx.post(f"{srv.url}/generate", json=busy, timeout=120))
    )
    worker.start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            cases = {
                '"temperature": 5e-324': "temperature",
                '"temperature": NaN': "temperature",
                '"temperature": Infinity': "temperature",
                '"top_p": 1e999': "top_p",
                '"top_p": -0.0': "top_p",
                '"top_k": -18446744073709551616': "top_k",
                '"stop_token_ids": [18446744073709551616]': "stop_token_ids",
                '"stop_token_ids": [100000]': "stop_token_ids",
                '"max_new_tokens": 1e308': "max_new_tokens",
            }
            for edge, field in cases.items():
                reply = _raw(http, "/generate", '{"text": "sort 2:", "sampling_params": {' + edge + "}}")
                assert reply.status_code in (400, 422) and field in reply.text, (edge, reply.text)
            for fine in ('"temperature": 1e308', '"temperature": -0.0', '"top_k": 18446744073709551616'):
                reply = _raw(
                    http,
                    "/generate",
                    '{"text": "sort 2:", "sampling_params": {"max_new_tokens": 2, ' + fine + "}}",
                )
                assert reply.status_code == 200, (fine, reply.text)
            stops = http.post("/generate", json={"text": "a", "sampling_params": {"stop": ["x"] * 20000}})
            assert stops.status_code == 422 and "sampling_params.stop" in stops.text
            big = http.post("/generate", json={"text": "a" * (2 * 2**20)})
            assert big.status_code == 413 and "limit" in big.text
        worker.join(120)
        assert long_reply[0].status_code == 200, long_reply[0].text
        assert long_reply[0].json()["meta_info"]["completion_tokens"] == 120
    finally:
        srv.stop()


class WatchedTokenizer:
    """The tokenizer, with events around each call: whether one is under way is known, not timed."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.started, self.finished = threading.Event(), threading.Event()

    def __call__(self, *args, **kwargs):
        self.started.set()
        try:
            return self.tokenizer(*args, **kwargs)
        finally:
            self.finished.set()

    def __getattr__(self, name: str):
        return getattr(self.tokenizer, name)


def test_long_text_is_tokenised_off_the_event_loop(tiny_model_dir, tokenizer) -> None:
    engine = make_engine(tiny_model_dir, tokenizer, seed=3)
    watched = WatchedTokenizer(tokenizer)
    srv = ServerThread(create_app(engine, watched))
    text = "sort 12345: " * 150_000  # 1.8 MB: seconds of tokenising
    worker = threading.Thread(
        target=lambda: httpx.post(f"{srv.url}/generate", json={"text": text}, timeout=300)
    )
    try:
        worker.start()
        assert watched.started.wait(120), "the long text never reached the tokenizer"
        assert httpx.get(f"{srv.url}/health", timeout=60).status_code == 200
        # answered while the tokenizer still works on the text: the event loop was not blocked by it
        assert not watched.finished.is_set(), "/health waited for the tokenizer"
        worker.join(300)
    finally:
        srv.stop()


def test_token_covers_the_schema_and_docs(tiny_model_dir, tokenizer) -> None:
    engine = make_engine(tiny_model_dir, tokenizer, seed=3)
    srv = ServerThread(create_app(engine, tokenizer, token="s3cret"))
    try:
        for path in ("/openapi.json", "/docs", "/redoc"):
            assert httpx.get(f"{srv.url}{path}").status_code == 401, path
        auth = {"Authorization": "Bearer s3cret"}
        assert "/generate" in httpx.get(f"{srv.url}/openapi.json", headers=auth).json()["paths"]
    finally:
        srv.stop()


def test_weights_load_only_from_real_checked_files(tiny_model_dir, tokenizer, tmp_path) -> None:
    engine = make_engine(tiny_model_dir, tokenizer, seed=3)
    allowed, outside = tmp_path / "weights", tmp_path / "elsewhere"
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    good = save_weights_folder(state, None, outside / "good") / "model.safetensors"
    first = next(k for k, v in state.items() if v.is_floating_point())

    def folder(name: str) -> Path:
        (allowed / name).mkdir(parents=True)
        return allowed / name

    (folder("link") / "model.safetensors").symlink_to(good)
    os.mkfifo(folder("fifo") / "model.safetensors")
    data = good.read_bytes()
    (folder("truncated") / "model.safetensors").write_bytes(data[: len(data) // 2])
    (folder("corrupt") / "model.safetensors").write_bytes(b"\xff" * 64)
    save_weights_folder(state | {first: torch.full_like(state[first], float("nan"))}, None, allowed / "nan")
    save_weights_folder(state | {first: state[first].long()}, None, allowed / "dtype")
    save_weights_folder(state | {first: state[first][:1]}, None, allowed / "shape")
    expected = {
        "link": "outside",
        "fifo": "not a regular file",
        "truncated": "model.safetensors is not a readable safetensors file",
        "corrupt": "model.safetensors is not a readable safetensors file",
        "nan": "non-finite",
        "dtype": "dtype",
        "shape": "shape",
    }
    srv = ServerThread(create_app(engine, tokenizer, weights_dirs=[str(allowed)]))
    body = {"text": "sort 31:", "sampling_params": GREEDY}
    try:
        with httpx.Client(base_url=srv.url, timeout=20) as http:
            before = http.post("/generate", json=body).json()["output_ids"]
            for name, cause in expected.items():
                reply = http.post("/update_weights_from_disk", json={"model_path": str(allowed / name)})
                assert reply.status_code == 400 and cause in reply.json()["detail"], (name, reply.text)
                assert reply.headers.get("connection") != "close", name
            assert http.get("/get_model_info").json()["weight_version"] == 0
            assert http.post("/generate", json=body).json()["output_ids"] == before  # the old weights serve
    finally:
        srv.stop()
