"""A rollout engine behind an HTTP server speaking SGLang's native API, so one client drives ours and theirs.

Endpoints (the subset of SGLang's native server RL loops use): ``POST /generate`` (``input_ids`` or
``text``, ``sampling_params``, ``return_logprob``, ``rid``; one object per sample, a list for batches or
``n > 1``), ``GET /health``, ``GET|POST /flush_cache``, ``POST /release_memory_occupation`` and
``/resume_memory_occupation`` (the KV cache), ``POST /update_weights_from_disk``,
``POST /pause_generation``, ``POST /continue_generation``, ``POST /abort_request``, ``GET /get_model_info``.

Start one: ``python -m relax_core.engines.http_server --model PATH --port N`` (or ``relax-engine-server``).
A background thread steps the engine while it has work, so concurrent requests share decode steps
(continuous batching).

Every request is answered: a body the engine cannot serve gets a 4xx naming the cause (token ids outside
the vocabulary, prompt plus ``max_new_tokens`` beyond the model's context, more samples than the engine
decodes together, a KV cache larger than ``--kv-cache-gb``), and a job that fails inside the engine
answers with its error instead of leaving its caller waiting. Weights load only from ``--weights-dir``
folders (default: the server's working directory, a run's directory) with every tensor's name and shape
checked. Bound beyond loopback, the server needs ``--token`` (the control plane's rule). SIGTERM aborts
whatever is running and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import stat
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import FastAPI, HTTPException
from pydantic import AfterValidator, BaseModel, Field

from relax_core.engines.base import GenerationRequest, SamplingParams
from relax_core.errors import RelaxUserError
from relax_core.runtime.http_auth import check_security, check_temperature, guard

log = logging.getLogger("relax.engine_server")


class SamplingBody(BaseModel):
    max_new_tokens: int = Field(16, ge=0)
    temperature: Annotated[float, AfterValidator(check_temperature)] = Field(1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(-1, ge=-1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1)


class GenerateBody(BaseModel):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingBody = Field(default_factory=SamplingBody)
    return_logprob: bool = False
    rid: str | list[str] | None = None


class UpdateWeightsBody(BaseModel):
    model_path: str = Field(min_length=1)
    weight_version: int | None = Field(None, ge=0)
    flush_cache: bool = True


class AbortBody(BaseModel):
    rid: str = ""
    abort_all: bool = False


class PauseBody(BaseModel):
    mode: Literal["abort", "in_place", "retract"] = "abort"


@dataclass
class ServerLimits:
    """What one ``/generate`` request may ask of the engine (None: no limit known)."""

    vocab_size: int | None = None  # token ids must be in [0, vocab_size)
    max_context: int | None = None  # prompt + max_new_tokens
    max_samples: int | None = None  # prompts x n in one request
    kv_budget_bytes: int | None = None  # KV cache the engine may hold; a request needing more is refused
    kv_bytes_per_token: int = 0  # K and V of one position of one sample, all layers
    # the engine matches every stop string against each new token: many or long ones slow every request
    max_stop_strings: int = 256
    max_stop_chars: int = 1024  # per stop string
    max_stop_token_ids: int = 1024
    max_body_bytes: int = 16 * 2**20  # a bigger request body gets 413 before it is parsed

    @classmethod
    def of(cls, engine: Any, kv_cache_gb: float | None = None) -> ServerLimits:
        """Limits read from a :class:`TorchEngine`'s model config and slot count; ``kv_cache_gb`` defaults
        to a quarter of this machine's memory."""
        model = getattr(engine, "model", None)
        if model is None:
            return cls()
        cfg = model.config.get_text_config()
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        element = next(model.parameters()).element_size()
        if kv_cache_gb is None:
            import psutil

            kv_cache_gb = psutil.virtual_memory().total / 4 / 2**30
        return cls(
            vocab_size=model.get_input_embeddings().num_embeddings,
            max_context=getattr(cfg, "max_position_embeddings", None),
            max_samples=getattr(engine, "max_running", None),
            kv_budget_bytes=int(kv_cache_gb * 2**30),
            kv_bytes_per_token=2 * cfg.num_hidden_layers * kv_heads * head_dim * element,
        )

    def check_stops(self, sp: SamplingBody) -> None:
        """HTTP 422 naming the stop field beyond its limit or outside the vocabulary."""
        stops = [sp.stop] if isinstance(sp.stop, str) else sp.stop or []
        if len(stops) > self.max_stop_strings:
            raise HTTPException(
                422,
                f"sampling_params.stop has {len(stops)} strings, over the limit of {self.max_stop_strings}",
            )
        if any(len(s) > self.max_stop_chars for s in stops):
            raise HTTPException(
                422, f"a sampling_params.stop string is longer than the limit of {self.max_stop_chars} chars"
            )
        ids = sp.stop_token_ids or []
        if len(ids) > self.max_stop_token_ids:
            raise HTTPException(
                422,
                f"sampling_params.stop_token_ids has {len(ids)} ids, over the limit of {self.max_stop_token_ids}",
            )
        bad = [t for t in ids if not 0 <= t < (self.vocab_size if self.vocab_size is not None else 2**63)]
        if bad:
            raise HTTPException(
                422,
                f"sampling_params.stop_token_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
            )

    def check(self, prompts: list[list[int]], max_new_tokens: int, n: int) -> None:
        """HTTP 400 naming the first limit the request breaks."""
        if self.vocab_size is not None:
            bad = [t for p in prompts for t in p if not 0 <= t < self.vocab_size]
            if bad:
                raise HTTPException(
                    400, f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
                )
        longest = max(len(p) for p in prompts) + max_new_tokens
        if self.max_context is not None and longest > self.max_context:
            raise HTTPException(
                400,
                f"prompt ({longest - max_new_tokens} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"model's context of {self.max_context} tokens",
            )
        samples = len(prompts) * n
        if self.max_samples is not None and samples > self.max_samples:
            raise HTTPException(
                400,
                f"{len(prompts)} prompt(s) x n={n} = {samples} samples exceeds the {self.max_samples} this "
                "server decodes together (--max-running): split the request",
            )
        need = samples * longest * self.kv_bytes_per_token
        if self.kv_budget_bytes is not None and need > self.kv_budget_bytes:
            raise HTTPException(
                400,
                f"the request needs {need / 2**30:.2f} GiB of KV cache, over this server's "
                f"{self.kv_budget_bytes / 2**30:.2f} GiB (--kv-cache-gb): fewer samples or tokens",
            )


def regular_files(folder: Path, allowed: list[Path]) -> list[Path]:
    """The resolved ``*.safetensors`` files of ``folder``, refused (ValueError) unless each is a regular file
    inside ``allowed``: a symlink out of it, or a FIFO that would block the reader, is never opened."""
    files = []
    for f in sorted(folder.glob("*.safetensors")):
        real = f.resolve()
        if not any(real.is_relative_to(a.resolve()) for a in allowed):
            raise ValueError(f"{f.name} links to {real}, outside the folders weights load from")
        if not stat.S_ISREG(real.stat().st_mode):
            raise ValueError(f"{f.name} is not a regular file")
        files.append(real)
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    return files


def load_checked_weights(engine: Any, folder: Path, allowed: list[Path] | None = None) -> dict[str, Any]:
    """The ``*.safetensors`` tensors of ``folder`` (regular files inside ``allowed``, default ``folder``),
    refused unless each names a parameter of the engine's model with its shape and kind of dtype, holds only
    finite numbers, and every parameter is given (a tied copy may be left out)."""
    import torch
    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for f in regular_files(folder, allowed or [folder]):
        try:
            tensors = load_file(str(f))
        except Exception as exc:  # safetensors' own error type for a truncated or corrupt header
            raise ValueError(f"{f.name} is not a readable safetensors file: {exc}") from exc
        state.update(tensors)
        origin.update(dict.fromkeys(tensors, f.name))
    expected = engine.model.state_dict()
    unknown = sorted(set(state) - set(expected))
    if unknown:
        raise ValueError(f"tensors the model does not have: {unknown[:5]}")
    wrong = [
        f"{k} {tuple(v.shape)} != {tuple(expected[k].shape)}"
        for k, v in state.items()
        if v.shape != expected[k].shape
    ]
    if wrong:
        raise ValueError(f"shape mismatch: {wrong[:5]}")
    # a float parameter may arrive in another float precision; anything else must match exactly
    kinds = [
        f"{origin[k]}: {k} is {v.dtype}, the model's is {expected[k].dtype}"
        for k, v in state.items()
        if v.dtype != expected[k].dtype
        and not (v.dtype.is_floating_point and expected[k].dtype.is_floating_point)
    ]
    if kinds:
        raise ValueError(f"dtype mismatch: {kinds[:5]}")
    bad = [k for k, v in state.items() if v.dtype.is_floating_point and not bool(torch.isfinite(v).all())]
    if bad:
        raise ValueError(f"non-finite values (NaN or inf) in {origin[bad[0]]}: {bad[:5]}")
    given = {expected[k].data_ptr() for k in state}
    missing = sorted(k for k, v in expected.items() if k not in state and v.data_ptr() not in given)
    if missing:
        raise ValueError(f"missing tensors: {missing[:5]}")
    return state


def inside(path: str, folders: list[Path]) -> bool:
    """Whether ``path`` (symlinks resolved) lies in one of ``folders``; False for a path the OS refuses."""
    try:
        real = Path(path).resolve()
    except (OSError, ValueError):  # e.g. an embedded NUL byte
        return False
    return any(real.is_relative_to(f.resolve()) for f in folders)


class EngineLoop:
    """Steps a :class:`TorchEngine` in a daemon thread whenever requests are queued."""

    def __init__(self, engine: Any, idle_cache_bytes: int | None = None) -> None:
        self.engine = engine
        self.idle_cache_bytes = idle_cache_bytes
        self.wake = threading.Event()
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped:
            try:
                busy = self.engine.step() if hasattr(self.engine, "step") else False
            except Exception:  # keep serving; the engine answered the failed jobs with the error
                log.exception("engine step failed")
                busy = False
            if not busy:
                self._free_idle_cache()
                self.wake.wait(0.05)
                self.wake.clear()

    def _free_idle_cache(self) -> None:
        """A burst of requests may have grown the KV cache past the budget: give the memory back."""
        if self.idle_cache_bytes is not None and hasattr(self.engine, "cache_bytes"):
            if self.engine.cache_bytes() > self.idle_cache_bytes:
                self.engine.flush_cache()

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()


def _finish_reason(reason: str, matched: Any = None) -> dict[str, Any]:
    if reason == "length":
        return {"type": "length"}
    if reason == "abort":
        return {"type": "abort", "message": "aborted"}
    return {"type": "stop", "matched": matched}


def create_app(
    engine: Any,
    tokenizer: Any = None,
    model_path: str = "",
    weights_dirs: list[str] | None = None,
    token: str | None = None,
    limits: ServerLimits | None = None,
) -> FastAPI:
    """The FastAPI app serving ``engine`` (a :class:`RolloutEngine`; step-able engines batch continuously).

    ``weights_dirs``: folders ``/update_weights_from_disk`` may load from (default: the working
    directory). ``token``: required as ``Authorization: Bearer`` on every request. ``limits``: default
    :meth:`ServerLimits.of` the engine.
    """
    limits = limits or ServerLimits.of(engine)
    allowed = [Path(d) for d in (weights_dirs or [os.getcwd()])]
    app = guard(FastAPI(title="Relax rollout engine (SGLang-compatible)"), token, limits.max_body_bytes)
    loop = EngineLoop(engine, limits.kv_budget_bytes)
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

    @app.get("/flush_cache", operation_id="flush_cache_get")
    @app.post("/flush_cache", operation_id="flush_cache_post")
    def flush_cache() -> dict[str, Any]:
        if hasattr(engine, "flush_cache"):
            engine.flush_cache()
        return {"success": True, "message": "cache flushed"}

    @app.post("/release_memory_occupation")
    def release_memory_occupation() -> dict[str, Any]:
        engine.release_memory()  # the KV cache; the next admission re-creates it
        return {"success": True, "message": "memory released"}

    @app.post("/resume_memory_occupation")
    def resume_memory_occupation() -> dict[str, Any]:
        engine.resume_memory()
        return {"success": True, "message": "memory resumed"}

    @app.post("/update_weights_from_disk")
    def update_weights_from_disk(body: UpdateWeightsBody) -> dict[str, Any]:
        version = body.weight_version if body.weight_version is not None else engine.weight_version + 1
        if not inside(body.model_path, allowed):
            raise HTTPException(
                403,
                f"{body.model_path} is outside the folders weights load from ({', '.join(map(str, allowed))})",
            )
        try:
            if hasattr(engine, "model"):
                state = load_checked_weights(engine, Path(body.model_path).resolve(), allowed)
                engine.update_weights(state, version)
            else:
                engine.update_weights_from_disk(body.model_path, version)
        except (ValueError, OSError, RuntimeError) as exc:
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
        limits.check_stops(body.sampling_params)
        batched = isinstance(body.input_ids, list) and body.input_ids and isinstance(body.input_ids[0], list)
        if body.input_ids is not None:
            prompts = body.input_ids if batched else [body.input_ids]
        else:
            if tokenizer is None:
                raise HTTPException(400, "this server has no tokenizer: send input_ids")
            texts = body.text if isinstance(body.text, list) else [body.text]
            batched = isinstance(body.text, list)
            # megabytes of text take a while to tokenise: off the event loop, which serves everyone
            prompts = await asyncio.to_thread(lambda: [tokenizer(t).input_ids for t in texts])
        if not prompts or any(not p for p in prompts):
            raise HTTPException(400, "empty prompt")
        if isinstance(body.rid, list) and len(body.rid) != len(prompts):
            raise HTTPException(400, f"rid has {len(body.rid)} entries for {len(prompts)} prompts")
        sp = body.sampling_params
        limits.check(prompts, sp.max_new_tokens, sp.n)
        stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
        sampling = SamplingParams(
            max_new_tokens=sp.max_new_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            # a top_k beyond the vocabulary keeps every token: -1 says so without a huge int
            top_k=sp.top_k if limits.vocab_size is None or sp.top_k < limits.vocab_size else -1,
            stop_token_ids=list(sp.stop_token_ids or []),
            stop_strings=stop,
            ignore_eos=sp.ignore_eos,
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
                if job.error is not None:
                    raise HTTPException(500, f"the engine failed on this request: {job.error}")
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


def build_server_engine(
    model_path: str,
    dtype: str = "float32",
    seed: int = 0,
    max_running: int = 1024,
    native_kernels: bool = False,
):
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
        native_kernels=native_kernels,
    )
    return engine, tokenizer


def guard_process_group(owner_pid: int) -> None:
    """Fork a watchdog that SIGKILLs this server's process group (vLLM's engine-core children included) once
    the process that started the server (a Rollout or judge engine actor) or the server itself is gone: no orphan engines.

    A process of its own, because a Ray worker that exits kills its direct children (this server) by PID,
    which would leave vLLM's engine core running if the watch lived in the server.
    """
    server_pid = os.getpid()
    if os.fork() != 0:
        return
    try:
        while os.getppid() == server_pid and _alive(owner_pid):  # orphaned the moment the server dies
            time.sleep(1.0)
        os.killpg(os.getpgid(0), signal.SIGKILL)
    finally:
        os._exit(0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def serve(app: FastAPI, engine: Any, host: str, port: int) -> None:
    """Run ``app`` until SIGINT/SIGTERM; the signal first aborts the engine's work, so requests stuck in
    it (a paused engine, a long generation) answer at once and the server exits."""
    import uvicorn

    class AbortingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            engine.abort()
            engine.resume()
            app.state.loop.wake.set()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=10)
    AbortingServer(config).run()
    app.state.loop.stop()


def main(argv: list[str] | None = None) -> None:
    """``python -m relax_core.engines.http_server --model PATH --port N``: serve until interrupted."""
    import torch

    parser = argparse.ArgumentParser(description="Relax rollout engine with an SGLang-compatible HTTP API")
    parser.add_argument("--model", required=True, help="local HF model folder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    parser.add_argument("--max-running", type=int, default=1024, help="samples decoded together")
    parser.add_argument(
        "--native-kernels",
        action="store_true",
        help="decode on the fused C++ kernels (rollout.native_kernels; fp32 or bf16 CPU, built on first use)",
    )
    parser.add_argument(
        "--weights-dir",
        action="append",
        help="folder /update_weights_from_disk may load from (repeatable; default: the working directory)",
    )
    parser.add_argument("--token", default=os.environ.get("RELAX_ENGINE_TOKEN"), help="bearer token")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit with every child once it is gone")
    parser.add_argument(
        "--kv-cache-gb", type=float, default=None, help="KV cache limit (default: a quarter of the memory)"
    )
    parser.add_argument(
        "--max-request-mb", type=float, default=16, help="request body limit (bigger ones get 413)"
    )
    parser.add_argument(
        "--max-stop-strings", type=int, default=256, help="stop strings one request may give (more: 422)"
    )
    args = parser.parse_args(argv)
    try:
        check_security(args.host, args.token, "--host", "--token (or RELAX_ENGINE_TOKEN)")
    except RelaxUserError as err:
        sys.exit(f"error: {err}")
    if args.parent_pid:
        guard_process_group(args.parent_pid)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        engine, tokenizer = build_server_engine(
            args.model, args.dtype, args.seed, args.max_running, args.native_kernels
        )
    except RelaxUserError as err:
        sys.exit(f"error: {err}")
    limits = ServerLimits.of(engine, args.kv_cache_gb)
    limits.max_body_bytes = int(args.max_request_mb * 2**20)
    limits.max_stop_strings = args.max_stop_strings
    app = create_app(engine, tokenizer, args.model, args.weights_dir, args.token, limits)
    log.info("serving %s on http://%s:%d", args.model, args.host, args.port)
    serve(app, engine, args.host, args.port)


if __name__ == "__main__":
    main()
