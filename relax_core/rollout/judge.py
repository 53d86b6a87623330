"""The GenRM judge as a role of the run: judge engines Relax places, watches, restarts and stops.

``reward=genrm reward.judge.path=<HF folder>`` (or ``reward.judge.model=tiny_qwen3``, a random-init judge
built into ``<run dir>/judge_init``) makes the mode start ``reward.judge.num_engines`` judge engines before
the other roles, and a router in the driver that forwards each ``/generate`` to the engine with the fewest
requests outstanding. ``reward.kwargs.url`` is set to the router, so the genrm reward reaches the judge by
URL from any reward worker process.

Placement: each engine is a :class:`JudgeEngine` role, a Ray actor in its bundle of the placement group
``relax-judge`` (``reward.judge.num_cpus`` logical CPUs and ``reward.judge.num_gpus`` GPUs each), on
whichever node Ray finds room, so a judge GPU is never one Ray gave another role. The role starts the engine
server (``python -m relax_core.engines.http_server``, Relax's torch engine with continuous batching, or vLLM's
server) on its node's 127.0.0.1 in a process group of its own, and the router reaches it through the actor.
With ``cluster=in_process`` (no Ray) the roles are objects in the driver and the servers its children.

Health: a thread asks every engine each ``reward.judge.health_interval_s`` to probe its server; a server
that died, or has not answered ``/health`` for ``reward.judge.hang_timeout_s`` (hung), is started again on
its port, and an engine whose actor is gone (killed, or its node lost) is replaced by a new actor in the
same bundle. The router sends an engine nothing until it answers again and has generated one warm-up token
(at start too), so first-call costs do not land on genrm's ``timeout_s``. Restarts are the step metric
``judge/restarts``. A request that finds no engine up within ``reward.judge.wait_s`` is refused (503), which
genrm scores as a counted 0 (``reward/judge_errors``). An engine that never comes up at start stops the
launch with one line. A server outlives neither its role's process nor the driver (``--parent-pid``).
"""

from __future__ import annotations

import asyncio
import atexit
import importlib.resources
import json
import logging
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, HTTPException, Request, Response

from relax_core.engines.router import Router
from relax_core.engines.server_process import ServerProcess
from relax_core.errors import RelaxUserError
from relax_core.runtime import handles
from relax_core.runtime.groups import RoleGroup
from relax_core.runtime.placement import reserve
from relax_core.runtime.ray_errors import GetTimeoutError, RayActorError
from relax_models.ports import free_port

if TYPE_CHECKING:
    from relax_core.config.schema import RelaxConfig
    from relax_rewards.config import JudgeConfig

log = logging.getLogger("relax")
DTYPES = ("float32", "bfloat16", "float16")  # what the engine server's --dtype takes
# one token from a fresh server before the router hands it requests: its first forward pays one-off costs
# (kernel selection, allocator growth) that would otherwise land on the first genrm calls' timeout_s
WARM_UP_BODY = json.dumps({"text": "warm up", "sampling_params": {"max_new_tokens": 1}}).encode()


def judge_model_path(judge: JudgeConfig, output_dir: str, seed: int) -> str:
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


def engine_launch(judge: JudgeConfig, model_path: str, port: int, seed: int) -> EngineLaunch:
    """Relax's torch engine server, or vLLM's in vLLM's interpreter (``reward.judge.engine``); either exits
    with its children once the process that runs this (the judge engine's role) is gone."""
    if judge.engine == "vllm":
        from relax_core.engines.vllm import REPO_ROOT, server_command, server_env, vllm_python

        command = server_command(vllm_python(judge.vllm_python), model_path, port, seed, dtype=judge.dtype)
        launch = EngineLaunch(command, server_env(judge.num_threads), str(REPO_ROOT))
    else:
        command = [
            *(sys.executable, "-m", "relax_core.engines.http_server", "--model", model_path),
            *("--port", str(port), "--threads", str(judge.num_threads), "--dtype", judge.dtype),
            *("--seed", str(seed), "--max-running", str(judge.max_running), "--parent-pid", str(os.getpid())),
        ]
        launch = EngineLaunch(command, dict(os.environ))
    if not judge.num_gpus:  # a CPU judge: no GPU of the node, whatever the process that starts it sees
        launch.env["CUDA_VISIBLE_DEVICES"] = ""
    return launch


class JudgeEngine:
    """One judge engine: a server process on 127.0.0.1 of the node this role runs on, which the role
    starts, probes, restarts when dead or hung, and forwards the router's requests to.

    No Ray logic: the run wraps it into a Ray actor in the judge's placement group (``RoleGroup``), or keeps
    it an object in the driver with ``cluster=in_process``. The port is fixed for the role's life.
    """

    def __init__(self, judge: JudgeConfig, model_path: str, seed: int, replica: int = 0) -> None:
        self.judge = judge
        self.port = free_port()
        self.launch = engine_launch(judge, model_path, self.port, seed + replica)
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = self._start()
        self.started = time.monotonic()
        self.last_healthy: float | None = None  # None: not up since its (re)start

    def _start(self) -> ServerProcess:
        return ServerProcess(self.launch.command, self.launch.env, cwd=self.launch.cwd)

    def wait_up(self) -> str | None:
        """None once the server answers ``/health`` and has generated its warm-up token; else why it did
        not answer within ``startup_timeout_s``."""
        try:
            self.process.wait_healthy(self.healthy, "judge engine", self.judge.startup_timeout_s)
        except RuntimeError as err:
            return str(err)
        self.warm_up()
        return None

    def warm_up(self) -> None:
        """One short generation (``WARM_UP_BODY``); a failure is logged: ``/health`` decides routing."""
        request = urllib.request.Request(
            f"{self.url}/generate", WARM_UP_BODY, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.judge.startup_timeout_s) as reply:
                reply.read()
        except OSError as err:  # refused, timed out, or an HTTP error status
            log.warning("judge engine at %s failed its warm-up generation: %s", self.url, err)

    def pid(self) -> int:
        return self.process.pid

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5.0) as reply:
                ok = self.process.alive() and reply.status == 200
        except OSError:  # refused, timed out, or an HTTP error status
            ok = False
        if ok:
            self.last_healthy = time.monotonic()
        return ok

    def check(self) -> tuple[bool, str | None]:
        """(the server answers ``/health``, why it was started again or None). A server whose process died,
        or that has not answered for ``hang_timeout_s`` since it was last up (``startup_timeout_s`` since
        its start), is stopped with its process group and started again on its port. A restarted server
        is warmed up before it counts as up."""
        restarted = self.last_healthy is None
        if self.healthy():
            if restarted:
                self.warm_up()
            return True, None
        if not self.process.alive():
            fault = f"died (exit code {self.process.popen.poll()})"
        else:
            up = self.last_healthy is not None
            since = self.last_healthy if up else self.started
            silent = time.monotonic() - since
            fault = None
            if silent > (self.judge.hang_timeout_s if up else self.judge.startup_timeout_s):
                fault = f"hung (no /health answer for {silent:.0f} s)"
        if fault is not None:
            self.process.stop(grace_s=1.0)  # reap it and anything left in its group
            self.process = self._start()
            self.started, self.last_healthy = time.monotonic(), None
        return False, fault

    def generate(self, body: bytes) -> tuple[int, bytes]:
        """The server's (status, reply) to one ``/generate`` body; an OSError when it cannot be reached
        (genrm's own timeout bounds the request at the caller)."""
        request = urllib.request.Request(
            f"{self.url}/generate", body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request) as reply:
                return reply.status, reply.read()
        except urllib.error.HTTPError as err:  # the engine answered, with an error status: pass it on
            return err.code, err.read()

    def shutdown(self) -> None:
        self.process.stop(grace_s=5.0)


class JudgeGroup:
    """``reward.judge.num_engines`` judge engines behind a router at :attr:`url`; see the module doc."""

    def __init__(self, judge: JudgeConfig, model_path: str, seed: int = 0, placed: bool = True) -> None:
        """``placed``: each engine is a Ray actor in a bundle of the placement group ``relax-judge``
        (``reward.judge.num_cpus``/``num_gpus`` each); else an object in this process."""
        from relax_core.engines.http_server import ServerThread

        self.cfg = judge
        self.restarts = 0
        # the router forwards every judge request with httpx, which logs each at INFO: the run log keeps its lines
        logging.getLogger("httpx").setLevel(logging.WARNING)
        self.router = Router()
        n = judge.num_engines
        bundle = {"CPU": judge.num_cpus} | ({"GPU": judge.num_gpus} if judge.num_gpus else {})
        shares = "reward.judge.num_cpus/num_gpus"
        self.pg = reserve([bundle] * n, "relax-judge", shares=shares) if placed else None
        # a thread per request the router may hand one engine, and spare ones for the health probe
        self.group = RoleGroup(
            *(JudgeEngine, "judge", n, self.pg, list(range(n)), judge.num_cpus, judge.num_gpus),
            args=(judge, model_path, seed),
            pass_replica=True,
            max_concurrency=judge.max_running * n + 2,
        )
        self.forwarders = ThreadPoolExecutor(judge.max_running * n, thread_name_prefix="judge-forward")
        try:
            for i, reason in enumerate(handles.get(self.group.call("wait_up"))):
                if reason is not None:
                    raise RelaxUserError(
                        f"reward.judge: judge engine {i} for {model_path} did not answer /health within "
                        f"reward.judge.startup_timeout_s={judge.startup_timeout_s:g} s (its log is above): "
                        "check reward.judge.path, or raise the timeout"
                    )
                self.router.add(i)
            self.server = ServerThread(self._app())
        except BaseException:
            self._stop_engines()
            raise
        self._stopped = threading.Event()
        self.watcher = threading.Thread(target=self._watch, name="judge-health", daemon=True)
        self.watcher.start()
        atexit.register(self.stop)
        where = "in Ray's placement group relax-judge" if placed else "in this process"
        log.info("judge up: %d engine(s) of %s %s, behind %s", n, model_path, where, self.url)

    @property
    def url(self) -> str:
        return self.server.url

    def _forward(self, key: int, body: bytes) -> tuple[int, bytes]:
        return handles.get(self.group.actors[key].generate.remote(body))

    def _app(self) -> FastAPI:
        """The router: ``/generate`` forwarded whole to the routable engine with the fewest outstanding
        requests (an engine that cannot be reached is marked down and the next one tried)."""
        app = FastAPI(title="Relax judge router")

        @app.get("/health")
        def health() -> dict[str, str]:
            if not self.router.keys(routable_only=True):
                raise HTTPException(503, "no judge engine is up")
            return {"status": "ok"}

        @app.post("/generate")
        async def generate(request: Request) -> Response:
            body = await request.body()
            loop = asyncio.get_running_loop()
            deadline = time.monotonic() + self.cfg.wait_s
            while True:
                try:
                    key = self.router.assign([1])[0]
                except RuntimeError:  # none up: one is being restarted
                    if time.monotonic() > deadline:
                        raise HTTPException(503, "no judge engine is up") from None
                    await asyncio.sleep(0.1)
                    continue
                try:
                    status, reply = await loop.run_in_executor(self.forwarders, self._forward, key, body)
                except (OSError, RayActorError):  # its server or its actor is gone
                    self.router.mark_unhealthy(key)  # the watcher restarts it and routes to it once up
                    continue
                finally:
                    self.router.release(key, 1)
                return Response(reply, status, media_type="application/json")

        return app

    def _watch(self) -> None:
        while not self._stopped.wait(self.cfg.health_interval_s):
            for key in self.router.keys():
                try:
                    ok, fault = handles.get(self.group.actors[key].check.remote(), timeout=60.0)
                except (RayActorError, GetTimeoutError) as err:  # its actor is gone (or its node): a new one
                    if self._stopped.is_set():
                        return
                    ok, fault = False, f"lost its actor ({type(err).__name__})"
                    self.group.restart(key)
                (self.router.mark_healthy if ok else self.router.mark_unhealthy)(key)
                if fault is not None and not self._stopped.is_set():
                    self.restarts += 1
                    log.warning("judge engine %d %s: started again (restart %d)", key, fault, self.restarts)

    def metrics(self) -> dict[str, float]:
        return {"judge/restarts": float(self.restarts)}

    def _stop_engines(self) -> None:
        try:
            handles.get(self.group.call("shutdown"), timeout=60.0)
        except (RayActorError, GetTimeoutError):
            pass  # gone already: its server followed it (--parent-pid)
        self.group.kill()
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)

    def stop(self) -> None:
        """Stop the router and every judge engine with its process group (idempotent)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.watcher.join(timeout=90)
        self.server.stop()
        self.forwarders.shutdown(wait=False, cancel_futures=True)
        self._stop_engines()


def start_judge(cfg: RelaxConfig) -> JudgeGroup | None:
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
    if judge.num_cpus <= 0 and judge.num_gpus <= 0:
        raise RelaxUserError("reward.judge.num_cpus and num_gpus are both 0: a judge engine must reserve one")
    model_path = judge_model_path(judge, cfg.output_dir, cfg.seed)
    group = JudgeGroup(judge, model_path, cfg.seed, placed=cfg.cluster.name != "in_process")
    cfg.reward.kwargs["url"] = group.url
    return group
