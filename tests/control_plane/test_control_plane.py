"""The control plane over real HTTP: its security and validation in-process, then elastic scaling against a
running training job (``python -m relax_launch control_plane.enabled=true ...`` in a subprocess)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from relax_core.control_plane import create_app
from relax_core.engines.http_server import ServerThread
from relax_core.errors import RelaxUserError
from relax_core.http_auth import check_security
from relax_models.ports import free_port


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
            assert no_pool.status_code == 400 and "mode=colocate" in no_pool.json()["detail"]
    finally:
        server.stop()
    check_security("127.0.0.1", None)
    check_security("0.0.0.0", "token")
    with pytest.raises(RelaxUserError, match="control_plane.token"):
        check_security("0.0.0.0", None)


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_elastic_scaling_while_training(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    batch, n = 4, 4
    cmd = [
        sys.executable,
        "-m",
        "relax_launch",
        "control_plane.enabled=true",
        "trainer.total_steps=100000",
        "trainer.sft_warmup_steps=0",
        "trainer.eval_every=0",
        "data.num_eval=8",
        f"rollout.batch_size={batch}",
        f"rollout.n_samples_per_prompt={n}",
        "rollout.max_new_tokens=4",
        "rollout.num_threads=1",
        "rollout.health_check_interval_s=1",
        "trainer.num_threads=1",
        "cluster.num_cpus=4",
        "logger=jsonl",
        f"hydra.run.dir={run_dir}",
    ]
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    log_file = open(tmp_path / "job.log", "w")  # noqa: SIM115  (a file, not a pipe: a full pipe blocks the job)
    job = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    engine_server = None
    try:
        info_file = run_dir / "control_plane.json"
        _wait(lambda: info_file.is_file() or job.poll() is not None, 420, "control_plane.json")
        assert job.poll() is None, (tmp_path / "job.log").read_text()[-3000:]
        http = httpx.Client(base_url=json.loads(info_file.read_text())["url"], timeout=60)
        _wait(lambda: len(_steps(run_dir)) >= 2, 300, "the first training step")

        def status(kind: str, rid: str) -> dict:
            return http.get(f"/rollout/{kind}/{rid}").json()

        def finish(kind: str, rid: str) -> dict:
            return _wait(
                lambda: (s := status(kind, rid))["status"] not in _RUNNING and s, 180, f"{kind} {rid}"
            )

        # scale-out to 2 engines; anything else meanwhile is a conflict
        first = http.post("/rollout/scale_out", json={"num_replicas": 2})
        assert first.status_code == 202, first.text
        rid = first.json()["request_id"]
        assert http.post("/rollout/scale_out", json={"num_replicas": 3}).status_code == 409
        assert http.post("/rollout/scale_in", json={"num_replicas": 1}).status_code == 409
        assert finish("scale_out", rid)["status"] == "ACTIVE"
        engines = http.get("/rollout/engines").json()["engines"]
        assert [e["kind"] for e in engines] == ["launch", "scaled"]
        # target met: NOOP
        noop = http.post("/rollout/scale_out", json={"num_replicas": 2})
        assert noop.status_code == 200 and noop.json()["status"] == "NOOP"
        # cancel while CREATING: rolled back
        third = http.post("/rollout/scale_out", json={"num_replicas": 3}).json()
        cancelled = http.post(f"/rollout/scale_out/{third['request_id']}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "CANCELLED"
        assert len(http.get("/rollout/engines").json()["engines"]) == 2
        assert http.post(f"/rollout/scale_out/{rid}/cancel").status_code == 409  # finished: not cancellable
        assert http.get("/rollout/scale_out/nope").status_code == 404
        # an external engine: a second Relax engine server started with one command
        port = free_port()
        engine_server = subprocess.Popen(
            [sys.executable, "-m", "relax_core.engines.http_server", "--model", str(run_dir / "model_init")]
            + ["--port", str(port), "--threads", "1"]
            # the run publishes weight folders under its run dir: the server may load only from there
            + ["--weights-dir", str(run_dir / "rollout_weights")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}"
        _wait(lambda: _healthy(url), 120, "the external engine server")
        ext = http.post("/rollout/scale_out", json={"engine_urls": [url]})
        assert ext.status_code == 202
        assert finish("scale_out", ext.json()["request_id"])["status"] == "ACTIVE"
        assert http.post("/rollout/scale_out", json={"engine_urls": [url]}).json()["status"] == "NOOP"
        engines = http.get("/rollout/engines").json()["engines"]
        assert [e["kind"] for e in engines] == ["launch", "scaled", "external"]
        joined_at = len(_steps(run_dir))
        _wait(
            lambda: any(s.get("rollout/engines_used") == 3 for s in _steps(run_dir)[joined_at:]),
            120,
            "3 engines used",
        )
        # launch engines are protected; a dry run names the newest engines first
        low = http.post("/rollout/scale_in", json={"num_replicas": 0})
        assert low.status_code == 400 and "protected" in low.json()["detail"]
        plan = http.post("/rollout/scale_in", json={"num_replicas": 1, "dry_run": True}).json()
        assert plan["engines"] == [engines[2]["id"], engines[1]["id"]]
        assert http.post("/rollout/scale_in", json={"engine_urls": ["http://127.0.0.1:1"]}).status_code == 400
        # scale-in: the external one by URL (drained), then forced down to the launch engine
        out = http.post("/rollout/scale_in", json={"engine_urls": [url]})
        assert finish("scale_in", out.json()["request_id"])["status"] == "COMPLETED"
        out = http.post("/rollout/scale_in", json={"num_replicas": 1, "force": True})  # abort + re-route
        assert finish("scale_in", out.json()["request_id"])["status"] == "COMPLETED"
        assert [e["id"] for e in http.get("/rollout/engines").json()["engines"]] == ["launch-0"]
        assert http.post("/rollout/scale_in", json={"num_replicas": 1}).json()["status"] == "NOOP"
        shrunk_at = len(_steps(run_dir))
        _wait(lambda: len(_steps(run_dir)) >= shrunk_at + 2, 120, "training after scale-in")
        assert http.get("/metrics").json()["step"] >= shrunk_at
        assert http.get("/health").json()["status"] == "ok"
    finally:
        if engine_server is not None:
            engine_server.terminate()
            engine_server.wait(timeout=30)
        job.send_signal(signal.SIGINT)
        try:
            job.wait(timeout=60)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait()
        log_file.close()
    steps = [s for s in _steps(run_dir) if s["step"] >= 1]
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    for s in steps:  # every step: batch x n samples, none lost or duplicated, across every change
        assert s["rollout/num_samples"] == batch * n == s["rollout/unique_samples"], s
    assert {s["rollout/num_engines"] for s in steps} >= {1.0, 2.0, 3.0}


_RUNNING = {"PENDING", "CREATING", "CONNECTING", "HEALTH_CHECKING", "WEIGHT_SYNCING", "DRAINING", "REMOVING"}


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class _RecordingPool:
    """Stands in for the run's rollout pool (a Ray cluster) only to record what the control plane asks."""

    def __init__(self) -> None:
        from relax_core.config import RelaxConfig

        self.cfg = RelaxConfig()
        self.calls: list[tuple] = []

    def scale_out(self, *args):
        from relax_core.rollout_pool import ScaleError

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
