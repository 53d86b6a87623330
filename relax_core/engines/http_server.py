"""A rollout engine behind an HTTP server speaking SGLang's native API, so one client drives ours and theirs.

Endpoints (the subset of SGLang's native server RL loops use): ``POST /generate`` (``input_ids`` or
``text``, ``sampling_params``, ``return_logprob``, ``rid``; one object per sample, a list for batches or
``n > 1``), ``GET /health``, ``GET|POST /flush_cache``, ``POST /update_weights_from_disk``,
``POST /pause_generation``, ``POST /continue_generation``, ``POST /abort_request``, ``GET /get_model_info``.

Start one: ``python -m relax_core.engines.http_server --model PATH --port N`` (or ``relax-engine-server``).
A background thread steps the engine while it has work, so concurrent requests share decode steps
(continuous batching).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading
import time
from typing import Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

from relax_core.engines.base import GenerationRequest, SamplingParams

log = logging.getLogger("relax.engine_server")


class SamplingBody(BaseModel):
    max_new_tokens: int = Field(16, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1)


class GenerateBody(BaseModel):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingBody = Field(default_factory=SamplingBody)
    return_logprob: bool = False
    rid: str | list[str] | None = None


class UpdateWeightsBody(BaseModel):
    model_path: str
    weight_version: int | str | None = None
    flush_cache: bool = True


class AbortBody(BaseModel):
    rid: str = ""
    abort_all: bool = False


class PauseBody(BaseModel):
    mode: str = "abort"


class EngineLoop:
    """Steps a :class:`TorchEngine` in a daemon thread whenever requests are queued."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.wake = threading.Event()
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped:
            try:
                busy = self.engine.step() if hasattr(self.engine, "step") else False
            except Exception:  # keep serving; the failing jobs are reported by their handlers' timeouts
                log.exception("engine step failed")
                busy = False
            if not busy:
                self.wake.wait(0.05)
                self.wake.clear()

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()


def _finish_reason(reason: str, matched: Any = None) -> dict[str, Any]:
    if reason == "length":
        return {"type": "length"}
    if reason == "abort":
        return {"type": "abort", "message": "aborted"}
    return {"type": "stop", "matched": matched}


def create_app(engine: Any, tokenizer: Any = None, model_path: str = "") -> FastAPI:
    """The FastAPI app serving ``engine`` (a :class:`RolloutEngine`; step-able engines batch continuously)."""
    app = FastAPI(title="Relax rollout engine (SGLang-compatible)")
    loop = EngineLoop(engine)
    app.state.loop = loop
    app.state.engine = engine
    paused = threading.Event()
    counter = {"n": 0}

    @app.get("/health")
    @app.get("/health_generate")
    def health() -> dict[str, str]:
        if not engine.health():
            raise HTTPException(503, "engine unhealthy")
        return {"status": "ok"}

    @app.get("/get_model_info")
    def model_info() -> dict[str, Any]:
        return {
            "model_path": model_path,
            "weight_version": engine.weight_version,
            "is_generation": True,
            "num_running": engine.num_running() if hasattr(engine, "num_running") else 0,
        }

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    def flush_cache() -> dict[str, Any]:
        if hasattr(engine, "flush_cache"):
            engine.flush_cache()
        return {"success": True, "message": "cache flushed"}

    @app.post("/update_weights_from_disk")
    def update_weights_from_disk(body: UpdateWeightsBody) -> dict[str, Any]:
        version = int(body.weight_version) if body.weight_version is not None else engine.weight_version + 1
        try:
            engine.update_weights_from_disk(body.model_path, version)
        except (FileNotFoundError, OSError, RuntimeError) as exc:
            raise HTTPException(400, f"cannot load weights from {body.model_path}: {exc}") from exc
        return {"success": True, "message": f"loaded {body.model_path}", "weight_version": version}

    @app.post("/pause_generation")
    def pause(body: PauseBody | None = None) -> dict[str, Any]:
        paused.set()
        engine.pause()
        if body is not None and body.mode == "abort":
            engine.abort()
        return {"success": True}

    @app.post("/continue_generation")
    def resume() -> dict[str, Any]:
        paused.clear()
        engine.resume()
        loop.wake.set()
        return {"success": True}

    @app.post("/abort_request")
    def abort(body: AbortBody) -> dict[str, Any]:
        if not body.abort_all and not body.rid:
            raise HTTPException(400, "give rid (the request to abort) or abort_all=true")
        engine.abort(None if body.abort_all else [body.rid])
        loop.wake.set()
        return {"success": True}

    @app.post("/generate")
    async def generate(body: GenerateBody) -> Any:
        if body.input_ids is None and body.text is None:
            raise HTTPException(400, "give text or input_ids")
        batched = isinstance(body.input_ids, list) and body.input_ids and isinstance(body.input_ids[0], list)
        if body.input_ids is not None:
            prompts = body.input_ids if batched else [body.input_ids]
        else:
            if tokenizer is None:
                raise HTTPException(400, "this server has no tokenizer: send input_ids")
            texts = body.text if isinstance(body.text, list) else [body.text]
            batched = isinstance(body.text, list)
            prompts = [tokenizer(t).input_ids for t in texts]
        if not prompts or any(not p for p in prompts):
            raise HTTPException(400, "empty prompt")
        sp = body.sampling_params
        stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
        sampling = SamplingParams(
            max_new_tokens=sp.max_new_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            stop_token_ids=list(sp.stop_token_ids or []),
            stop_strings=stop,
            n=sp.n,
        )
        rids = body.rid if isinstance(body.rid, list) else [body.rid] * len(prompts)
        jobs = []
        for p, rid in zip(prompts, rids):
            counter["n"] += 1
            request = GenerationRequest(list(p), rid or f"req-{counter['n']}")
            if hasattr(engine, "submit"):
                jobs.append(engine.submit(request, sampling))
            else:
                jobs.append(await asyncio.to_thread(engine.generate, [request], sampling))
        loop.wake.set()
        out = []
        for p, job in zip(prompts, jobs):
            if hasattr(job, "done"):
                while not job.done.is_set():
                    await asyncio.sleep(0.002)
                results = job.results
            else:
                results = job
            for res in results:
                meta: dict[str, Any] = {
                    "id": res.request_id,
                    "finish_reason": _finish_reason(
                        res.finish_reason, res.output_ids[-1] if res.output_ids else None
                    ),
                    "prompt_tokens": len(p),
                    "completion_tokens": len(res.output_ids),
                    "weight_version": res.weight_version,
                }
                if body.return_logprob:
                    meta["output_token_logprobs"] = [
                        [lp, tok, None] for lp, tok in zip(res.logprobs, res.output_ids)
                    ]
                text = tokenizer.decode(res.output_ids, skip_special_tokens=True) if tokenizer else ""
                out.append({"text": text, "output_ids": res.output_ids, "meta_info": meta})
        return out if (batched or sampling.n > 1) else out[0]

    return app


class ServerThread:
    """Run a FastAPI app under uvicorn in a daemon thread; ``port`` is the bound port (0 picks one)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="http-server", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"HTTP server on {host}:{port} did not start")
            time.sleep(0.01)
        self.host = host
        self.port = self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def build_server_engine(model_path: str, dtype: str = "float32", seed: int = 0, max_running: int = 1024):
    """A :class:`TorchEngine` and tokenizer for ``model_path`` (the model family is read from its config)."""
    import torch
    from transformers import AutoConfig

    from relax_core.engines.torch_engine import TorchEngine
    from relax_models.families import FAMILIES, family_for_model_type
    from relax_models.loader import DTYPES, load_tokenizer

    tokenizer = load_tokenizer(model_path)
    family = family_for_model_type(AutoConfig.from_pretrained(model_path).model_type)
    model = FAMILIES[family].load(model_path, DTYPES.get(dtype, torch.float32))
    engine = TorchEngine(
        model,
        tokenizer.pad_token_id,
        [tokenizer.eos_token_id],
        seed=seed,
        tokenizer=tokenizer,
        family=family,
        max_running=max_running,
    )
    return engine, tokenizer


def main(argv: list[str] | None = None) -> None:
    """``python -m relax_core.engines.http_server --model PATH --port N``: serve until interrupted."""
    import torch
    import uvicorn

    parser = argparse.ArgumentParser(description="Relax rollout engine with an SGLang-compatible HTTP API")
    parser.add_argument("--model", required=True, help="local HF model folder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    parser.add_argument("--max-running", type=int, default=1024, help="samples decoded together")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    engine, tokenizer = build_server_engine(args.model, args.dtype, args.seed, args.max_running)
    app = create_app(engine, tokenizer, args.model)
    log.info("serving %s on http://%s:%d", args.model, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
