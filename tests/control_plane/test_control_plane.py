"""The control plane over real HTTP: its security and validation in-process. Elastic scaling against a
running training job is tested on a multi-node cluster (tests/multinode/test_multinode_ray.py)."""

from __future__ import annotations

import httpx
import pytest

from relax_core.engines.http_server import ServerThread
from relax_core.errors import RelaxUserError
from relax_core.rollout.control_plane import create_app
from relax_core.runtime.http_auth import check_security


def test_token_openapi_and_validation_without_a_job() -> None:
    server = ServerThread(create_app(lambda: None, lambda: {"step": 4, "reward/mean": 0.5}, token="s3cret"))
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            assert http.get("/health").status_code == 401
            auth = {"Authorization": "Bearer s3cret"}
            assert http.get("/health", headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert http.get("/health", headers=auth).json()["step"] == 4
            assert http.get("/metrics", headers=auth).json()["reward/mean"] == 0.5
            paths = http.get("/openapi.json", headers=auth).json()["paths"]
            assert {"/rollout/scale_out", "/rollout/scale_in", "/rollout/engines"} <= set(paths)
            bad = http.post("/rollout/scale_out", json={"num_replicas": -1}, headers=auth)
            assert bad.status_code == 422 and "num_replicas" in bad.text
            extra = http.post("/rollout/scale_out", json={"replicas": 2}, headers=auth)
            assert extra.status_code == 422
            no_pool = http.post("/rollout/scale_out", json={"num_replicas": 2}, headers=auth)
            assert no_pool.status_code == 400 and "no rollout pool" in no_pool.json()["detail"]
    finally:
        server.stop()
    check_security("127.0.0.1", None)
    check_security("0.0.0.0", "token")
    with pytest.raises(RelaxUserError, match="control_plane.token"):
        check_security("0.0.0.0", None)


class _RecordingPool:
    """Stands in for the run's rollout pool (a Ray cluster) only to record what the control plane asks."""

    def __init__(self) -> None:
        from relax_core.config.schema import RelaxConfig

        self.cfg = RelaxConfig()
        self.calls: list[tuple] = []

    def scale_out(self, *args):
        from relax_core.rollout.pool import ScaleError

        self.calls.append(args)
        raise ScaleError(409, "recorded")


def test_edge_numbers_start_nothing_and_engine_tokens_reach_the_client(tiny_model_dir, tokenizer) -> None:
    from relax_core.engines import build_engine
    from relax_core.engines.http_server import create_app as engine_app
    from relax_core.engines.torch_engine import TorchEngine
    from relax_models.loader import load_causal_lm

    pool = _RecordingPool()
    server = ServerThread(create_app(lambda: pool, lambda: {}))
    engine_srv = ServerThread(
        engine_app(
            TorchEngine(
                load_causal_lm(str(tiny_model_dir)), tokenizer.pad_token_id, [tokenizer.eos_token_id]
            ),
            tokenizer,
            token="e-tok",
        )
    )
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            for edge in ("NaN", "Infinity", "-Infinity", "1e999"):
                body = '{"num_replicas": 2, "timeout_secs": ' + edge + "}"
                reply = http.post(
                    "/rollout/scale_out", content=body, headers={"content-type": "application/json"}
                )
                assert reply.status_code == 422 and "timeout_secs" in reply.text, (edge, reply.text)
                body = '{"num_replicas": 1, "timeout_secs": ' + edge + "}"
                reply = http.post(
                    "/rollout/scale_in", content=body, headers={"content-type": "application/json"}
                )
                assert reply.status_code == 422 and "timeout_secs" in reply.text, (edge, reply.text)
            assert pool.calls == []  # nothing started
            join = {"engine_urls": [engine_srv.url + "/"], "engine_tokens": {engine_srv.url: "e-tok"}}
            assert http.post("/rollout/scale_out", json=join).status_code == 409
        assert pool.cfg.rollout.engine_tokens == {engine_srv.url: "e-tok"}
        client = build_engine(
            "torch", str(tiny_model_dir), tokenizer, None, 0, pool.cfg.rollout, engine_srv.url
        )
        assert client.health()  # the engine's token went with the client
        assert not build_engine(
            "torch", str(tiny_model_dir), tokenizer, None, 0, None, engine_srv.url
        ).health()
    finally:
        server.stop()
        engine_srv.stop()
