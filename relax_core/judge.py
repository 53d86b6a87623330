"""The GenRM judge as a role of the run: judge engines Relax starts, watches, restarts and stops.

``reward=genrm reward.judge.path=<HF folder>`` (or ``reward.judge.model=tiny_qwen3``, a random-init judge
built into ``<run dir>/judge_init``) makes the mode start ``reward.judge.num_engines`` engine servers
(``python -m relax_core.engines.http_server``: Relax's torch engine, continuous batching) as child processes
of the driver, each in its own process group on a port of 127.0.0.1, and a router in the driver that
forwards each ``/generate`` to the engine with the fewest requests outstanding. ``reward.kwargs.url`` is set
to the router, so the genrm reward reaches the judge by URL from any reward worker process.

Placement: the judge engines are processes of their own on the driver's node, outside Ray's placement
groups, with ``reward.judge.num_threads`` torch threads each; they take no share of the rollout engines'
or the Actor's reserved resources. They see the GPUs ``reward.judge.devices`` names (their
``CUDA_VISIBLE_DEVICES``), none by default: a judge never lands on a GPU Ray gave a role.

Health: a thread probes every engine each ``reward.judge.health_interval_s``; an engine whose process died,
or that has not answered ``/health`` for ``reward.judge.hang_timeout_s`` (hung), is started again on its
port, and the router sends it nothing until it answers ``/health``. Restarts are the step metric
``judge/restarts``. A request that
finds no engine up within ``reward.judge.wait_s`` is refused (503), which genrm scores as a counted 0
(``reward/judge_errors``). An engine that never comes up at start stops the launch with one line.
"""

from __future__ import annotations

import asyncio
import atexit
import importlib.resources
import logging
import os
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request, Response

from relax_core.engines.router import Router
from relax_core.engines.server_process import ServerProcess
from relax_core.errors import RelaxUserError
from relax_models.ports import free_port

log = logging.getLogger("relax")
DTYPES = ("float32", "bfloat16", "float16")  # what the engine server's --dtype takes


def judge_model_path(judge: Any, output_dir: str, seed: int) -> str:
    """``reward.judge.path``, or the ``reward.judge.model`` tiny spec of conf/model built under the run dir."""
    if judge.path:
        if not (Path(judge.path).expanduser() / "config.json").is_file():
            raise RelaxUserError(
                f"reward.judge.path={judge.path!r} is not a model folder (no config.json there); "
                "point it at a local Hugging Face checkpoint folder"
            )
        return str(Path(judge.path).expanduser())
    from relax_models.families import get_family

    family, dims = tiny_judge_spec(judge.model)
    # the judge reads a whole prompt template: room for it, whatever context the policy's twin has
    dims["max_position_embeddings"] = max(dims.get("max_position_embeddings", 0), 2048)
    return str(get_family(family).build_tiny(Path(output_dir) / "judge_init", seed=seed, **dims))


def tiny_judge_spec(name: str) -> tuple[str, dict[str, Any]]:
    """(family, tiny dimensions) of ``conf/model/<name>.yaml``, for ``reward.judge.model``."""
    from omegaconf import OmegaConf

    # the conf tree ships as the package data relax_launch.conf: read as files, nothing imported from it
    specs = Path(str(importlib.resources.files("relax_launch.conf") / "model"))
    spec_file = specs / f"{name}.yaml"
    spec = OmegaConf.load(spec_file) if spec_file.is_file() else None
    if spec is None or spec.get("tiny") is None:
        tiny = sorted(p.stem for p in specs.glob("tiny_*.yaml"))
        raise RelaxUserError(f"reward.judge.model={name!r} is not a tiny model spec; one of {tiny}")
    return spec.family, OmegaConf.to_container(spec.tiny)


@dataclass
class EngineLaunch:
    """How one judge engine's server process starts."""

    command: list[str]
    env: dict[str, str]
    cwd: str | None = None


def engine_launch(judge: Any, model_path: str, port: int, seed: int) -> EngineLaunch:
    """Relax's torch engine server, or vLLM's in vLLM's interpreter (``reward.judge.engine``)."""
    if judge.engine == "vllm":
        from relax_core.engines.vllm import REPO_ROOT, server_command, server_env, vllm_python

        command = server_command(vllm_python(judge.vllm_python), model_path, port, seed, dtype=judge.dtype)
        return EngineLaunch(command, server_env(judge.num_threads), str(REPO_ROOT))
    command = [
        *(sys.executable, "-m", "relax_core.engines.http_server", "--model", model_path),
        *("--port", str(port), "--threads", str(judge.num_threads), "--dtype", judge.dtype),
        *("--seed", str(seed), "--max-running", str(judge.max_running)),
    ]
    return EngineLaunch(command, dict(os.environ))


class JudgeEngine:
    """One judge engine server process on a fixed port (kept across restarts, so the router's key holds)."""

    def __init__(self, launch: EngineLaunch, port: int, startup_timeout_s: float, devices: str) -> None:
        self.port, self.startup_timeout_s = port, startup_timeout_s
        self.launch = EngineLaunch(launch.command, launch.env | {"CUDA_VISIBLE_DEVICES": devices}, launch.cwd)
        self.url = f"http://127.0.0.1:{port}"
        self.process = self._start()
        self.started = time.monotonic()
        self.last_healthy: float | None = None  # None: not up since its (re)start

    def _start(self) -> ServerProcess:
        return ServerProcess(self.launch.command, self.launch.env, cwd=self.launch.cwd)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5.0) as reply:
                ok = self.process.alive() and reply.status == 200
        except OSError:  # refused, timed out, or an HTTP error status
            ok = False
        if ok:
            self.last_healthy = time.monotonic()
        return ok

    def fault(self, hang_timeout_s: float) -> str | None:
        """Why this engine must be started again (its process died, or it stopped answering: since it was
        last up for ``hang_timeout_s``, or since its start for ``startup_timeout_s``), or None."""
        if not self.process.alive():
            return f"died (exit code {self.process.popen.poll()})"
        since, limit = (
            (self.started, self.startup_timeout_s)
            if self.last_healthy is None
            else (self.last_healthy, hang_timeout_s)
        )
        silent = time.monotonic() - since
        return f"hung (no /health answer for {silent:.0f} s)" if silent > limit else None

    def restart(self) -> None:
        self.process.stop(grace_s=1.0)  # reap it and anything left in its group
        self.process = self._start()
        self.started, self.last_healthy = time.monotonic(), None


class JudgeGroup:
    """``reward.judge.num_engines`` judge engines behind a router at :attr:`url`; see the module doc."""

    def __init__(self, judge: Any, model_path: str, seed: int = 0) -> None:
        from relax_core.engines.http_server import ServerThread

        self.cfg = judge
        self.restarts = 0
        # the router forwards every judge request with httpx, which logs each at INFO: the run log keeps its lines
        logging.getLogger("httpx").setLevel(logging.WARNING)
        self.router = Router()
        self.engines: list[JudgeEngine] = []
        for i in range(judge.num_engines):
            port = free_port()
            launch = engine_launch(judge, model_path, port, seed + i)
            self.engines.append(JudgeEngine(launch, port, judge.startup_timeout_s, judge.devices))
        try:
            for i, engine in enumerate(self.engines):
                try:
                    engine.process.wait_healthy(engine.healthy, f"judge engine {i}", judge.startup_timeout_s)
                except RuntimeError:
                    raise RelaxUserError(
                        f"reward.judge: judge engine {i} for {model_path} did not answer /health within "
                        f"reward.judge.startup_timeout_s={judge.startup_timeout_s:g} s (its log is above): "
                        "check reward.judge.path, or raise the timeout"
                    ) from None
                self.router.add(i)
            self.server = ServerThread(self._app())
        except BaseException:
            self._stop_engines()
            raise
        self._stopped = threading.Event()
        self.watcher = threading.Thread(target=self._watch, name="judge-health", daemon=True)
        self.watcher.start()
        atexit.register(self.stop)  # the engines run in sessions of their own: a driver that exits ends them
        log.info("judge up: %d engine(s) of %s behind %s", len(self.engines), model_path, self.url)

    @property
    def url(self) -> str:
        return self.server.url

    def _app(self) -> FastAPI:
        """The router: ``/generate`` forwarded whole to the routable engine with the fewest outstanding
        requests (an engine that refuses the connection is marked down and the next one tried)."""
        import httpx

        app = FastAPI(title="Relax judge router")
        clients: list[httpx.AsyncClient] = []  # made on the server's event loop, at the first request

        @app.get("/health")
        def health() -> dict[str, str]:
            if not self.router.keys(routable_only=True):
                raise HTTPException(503, "no judge engine is up")
            return {"status": "ok"}

        @app.post("/generate")
        async def generate(request: Request) -> Response:
            body = await request.body()
            if not clients:
                clients.append(httpx.AsyncClient(timeout=None))  # genrm's own timeout bounds a request
            client = clients[0]
            deadline = time.monotonic() + self.cfg.wait_s
            while True:
                try:
                    key = self.router.assign([1])[0]
                except RuntimeError:  # none up: one is being restarted
                    if time.monotonic() > deadline:
                        raise HTTPException(503, "no judge engine is up") from None
                    await asyncio.sleep(0.1)
                    continue
                engine = self.engines[key]
                try:
                    reply = await client.post(
                        f"{engine.url}/generate", content=body, headers={"Content-Type": "application/json"}
                    )
                except httpx.TransportError:
                    self.router.mark_unhealthy(key)  # the watcher restarts it and routes to it once up
                    continue
                finally:
                    self.router.release(key, 1)
                return Response(reply.content, reply.status_code, media_type="application/json")

        return app

    def _watch(self) -> None:
        while not self._stopped.wait(self.cfg.health_interval_s):
            for key, ok in self.router.check_health(lambda k: self.engines[k].healthy()).items():
                engine = self.engines[key]
                fault = None if ok or self._stopped.is_set() else engine.fault(self.cfg.hang_timeout_s)
                if fault is None:
                    continue
                self.restarts += 1
                log.warning("judge engine %d %s: starting it again (restart %d)", key, fault, self.restarts)
                engine.restart()

    def metrics(self) -> dict[str, float]:
        return {"judge/restarts": float(self.restarts)}

    def _stop_engines(self) -> None:
        for engine in self.engines:
            engine.process.stop(grace_s=5.0)

    def stop(self) -> None:
        """Stop the router and every judge engine with its process group (idempotent)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.watcher.join(timeout=30)
        self.server.stop()
        self._stop_engines()


def start_judge(cfg: Any) -> JudgeGroup | None:
    """The run's judge group when ``reward.judge`` names a model (``reward.kwargs.url`` then points at its
    router, for the reward workers the roles start next); None otherwise."""
    judge = cfg.reward.judge
    if judge is None or not judge.managed:
        return None
    if judge.num_engines < 1:
        raise RelaxUserError(f"reward.judge.num_engines={judge.num_engines}: give 1 or more")
    if judge.dtype not in DTYPES:
        raise RelaxUserError(f"reward.judge.dtype={judge.dtype!r} is not one of {DTYPES}")
    if judge.engine not in ("torch", "vllm"):
        raise RelaxUserError(f"reward.judge.engine={judge.engine!r} is not one of ['torch', 'vllm']")
    group = JudgeGroup(judge, judge_model_path(judge, cfg.output_dir, cfg.seed), cfg.seed)
    cfg.reward.kwargs["url"] = group.url
    return group
