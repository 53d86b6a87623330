"""HTTP control plane of a running job: health, latest metrics, and elastic rollout scaling.

FastAPI in a daemon thread of the driver, bound to 127.0.0.1 unless ``control_plane.host`` says otherwise
(then ``control_plane.token`` is required and every request must carry ``Authorization: Bearer <token>``).
The bound port is logged and written to ``<run dir>/control_plane.json``. Scaling calls return a request
id at once; the work runs in the background (see :mod:`relax_core.rollout.pool`). Bad bodies get a 4xx
with a message, never a 5xx; the OpenAPI schema is at ``/openapi.json``.

    POST /rollout/scale_out        {"num_replicas": N} | {"engine_urls": [...]}, optional "timeout_secs",
                                   "engine_tokens" ({url: token} for engines started with --token)
    GET  /rollout/scale_out[/{id}]          POST /rollout/scale_out/{id}/cancel
    POST /rollout/scale_in         {"num_replicas": N} | {"engine_urls": [...]}, "force", "dry_run"
    GET  /rollout/scale_in[/{id}]           GET /rollout/engines      GET /health      GET /metrics
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from relax_core.errors import RelaxUserError
from relax_core.rollout.pool import RolloutPool, ScaleError
from relax_core.runtime.http_auth import check_security, guard

if TYPE_CHECKING:
    from relax_core.config.schema import RelaxConfig

log = logging.getLogger("relax")


class ScaleOutBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    num_replicas: int | None = Field(None, ge=1, description="absolute target number of engines")
    engine_urls: list[str] | None = Field(
        None, min_length=1, description="external SGLang-compatible servers"
    )
    timeout_secs: float | None = Field(None, gt=0, allow_inf_nan=False)
    engine_tokens: dict[str, str] | None = Field(
        None, description="bearer token per engine URL, for engines that require one"
    )


class ScaleInBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    num_replicas: int | None = Field(None, ge=0, description="absolute target number of engines")
    engine_urls: list[str] | None = Field(None, min_length=1)
    force: bool = False
    dry_run: bool = False
    timeout_secs: float | None = Field(
        None, ge=0, allow_inf_nan=False, description="drain deadline (default rollout.drain_timeout_s)"
    )


def _valid_url(url: str) -> bool:
    return url.startswith(("http://", "https://")) and len(url) > len("http://")


def create_app(
    pool: Callable[[], RolloutPool | None],
    metrics: Callable[[], dict[str, Any]],
    token: str | None = None,
) -> FastAPI:
    """The control-plane app over the pool ``pool()`` returns (a call, so a global restart's new pool is
    used; None: scaling endpoints answer 400, e.g. before the engines start)."""

    app = guard(FastAPI(title="Relax control plane"), token)

    @app.exception_handler(ScaleError)
    async def scale_error(_: Request, err: ScaleError) -> JSONResponse:
        return JSONResponse({"detail": err.message}, status_code=err.status)

    @app.exception_handler(RelaxUserError)
    async def user_error(_: Request, err: RelaxUserError) -> JSONResponse:
        return JSONResponse({"detail": str(err)}, status_code=400)

    def need_pool() -> RolloutPool:
        if pool() is None:
            raise ScaleError(400, "no rollout pool: the run's engines are not up (starting or restarting)")
        return pool()  # type: ignore[return-value]

    @app.get("/health")
    def health() -> dict[str, Any]:
        latest = metrics()
        return {
            "status": "ok",
            "step": latest.get("step"),
            "engines": pool().num_active() if pool() is not None else None,
        }

    @app.get("/metrics")
    def latest_metrics() -> dict[str, Any]:
        return metrics()

    @app.get("/rollout/engines")
    def engines() -> dict[str, Any]:
        return {"engines": need_pool().engines()}

    @app.post("/rollout/scale_out", status_code=202)
    def scale_out(body: ScaleOutBody) -> Any:
        p = need_pool()
        bad = [u for u in body.engine_urls or [] if not _valid_url(u)]
        if bad:
            raise ScaleError(400, f"engine_urls must be http(s)://host:port URLs, got {bad}")
        tokens = {u.rstrip("/"): t for u, t in (body.engine_tokens or {}).items()}
        unknown = sorted(set(tokens) - {u.rstrip("/") for u in body.engine_urls or []})
        if unknown:
            raise ScaleError(400, f"engine_tokens names URLs not in engine_urls: {unknown}")
        # the engines' clients are built from the run's config: the tokens travel with it
        p.cfg.rollout.engine_tokens.update(tokens)
        req = p.scale_out(body.num_replicas, body.engine_urls, body.timeout_secs)
        code = 200 if req.finished else 202
        return JSONResponse(req.to_dict(), status_code=code)

    @app.get("/rollout/scale_out")
    def list_out() -> dict[str, Any]:
        return {"requests": need_pool().list_requests("scale_out")}

    @app.get("/rollout/scale_out/{request_id}")
    def get_out(request_id: str) -> dict[str, Any]:
        return need_pool().get_request(request_id, "scale_out").to_dict()

    @app.post("/rollout/scale_out/{request_id}/cancel")
    def cancel(request_id: str) -> dict[str, Any]:
        return need_pool().cancel(request_id).to_dict()

    @app.post("/rollout/scale_in", status_code=202)
    def scale_in(body: ScaleInBody) -> Any:
        result = need_pool().scale_in(
            body.num_replicas, body.engine_urls, body.force, body.dry_run, body.timeout_secs
        )
        if isinstance(result, dict):
            return JSONResponse(result, status_code=200)
        return JSONResponse(result.to_dict(), status_code=200 if result.finished else 202)

    @app.get("/rollout/scale_in")
    def list_in() -> dict[str, Any]:
        return {"requests": need_pool().list_requests("scale_in")}

    @app.get("/rollout/scale_in/{request_id}")
    def get_in(request_id: str) -> dict[str, Any]:
        return need_pool().get_request(request_id, "scale_in").to_dict()

    return app


class ControlPlane:
    """Serves :func:`create_app` in a thread and publishes where it listens."""

    def __init__(
        self, cfg: RelaxConfig, pool: Callable[[], RolloutPool | None], metrics: Callable[[], dict[str, Any]]
    ) -> None:
        from relax_core.engines.http_server import ServerThread

        cp = cfg.control_plane
        check_security(cp.host, cp.token)
        self.server = ServerThread(create_app(pool, metrics, cp.token), cp.host, cp.port)
        self.url = f"http://{cp.host}:{self.server.port}"
        info = {"host": cp.host, "port": self.server.port, "url": self.url, "pid": os.getpid()}
        path = Path(cfg.output_dir) / "control_plane.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(info))
        log.info("control plane listening on %s (written to %s)", self.url, path)

    def stop(self) -> None:
        self.server.stop()
