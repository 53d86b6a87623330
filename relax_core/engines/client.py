"""One HTTP client for every SGLang-compatible engine server: ours (``http_server``), SGLang, or a router.

It implements :class:`RolloutEngine`, so the Rollout role drives a remote server exactly like the
in-process engine: one ``POST /generate`` per prompt (its ``n`` samples share the server's prefill),
sent concurrently so the server batches them. Weights move in memory over a torch.distributed group
(``weight_transfer="distributed"``, SGLang's ``/update_weights_from_distributed``; see ``weight_broadcast``)
or through a folder per version (``/update_weights_from_disk``; the previous version's folder is deleted).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch

from relax_core.engines.base import GenerationRequest, GenerationResult, RolloutEngine, SamplingParams
from relax_core.engines.weight_broadcast import WeightBroadcaster
from relax_core.errors import RelaxUserError

FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
WEIGHT_TRANSFERS = ("distributed", "disk")


def parse_weight_version(value: Any, fallback: int) -> int:
    """A server's ``weight_version`` as an int; SGLang reports ``"default"`` before any update."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return fallback


def save_weights_folder(state_dict: dict[str, torch.Tensor], base_model_path: str | None, out: Path) -> Path:
    """Write ``state_dict`` as ``model.safetensors`` plus the base folder's config/tokenizer files, so a
    server that reloads a whole folder (SGLang) finds a complete checkpoint."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    if base_model_path:
        for f in Path(base_model_path).iterdir():
            if (
                f.is_file()
                and not f.name.endswith((".safetensors", ".bin"))
                and f.name != "model.safetensors.index.json"
            ):
                shutil.copy2(f, out / f.name)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    # tied embeddings share storage; safetensors refuses shared tensors
    seen: dict[int, str] = {}
    for k in list(tensors):
        ptr = tensors[k].data_ptr()
        if ptr in seen:
            tensors[k] = tensors[k].clone()
        seen[ptr] = k
    save_file(tensors, str(out / "model.safetensors"))
    return out


class HttpEngine(RolloutEngine):
    """Client of one engine server at ``url`` (``http://host:port``)."""

    def __init__(
        self,
        url: str,
        timeout_s: float = 600.0,
        base_model_path: str | None = None,
        max_concurrency: int = 64,
        token: str | None = None,
        weight_transfer: str = "disk",
        server_world_size: int = 1,
        weights_dir: str | None = None,
    ) -> None:
        """``weight_transfer``: ``distributed`` (in memory) or ``disk``; ``weights_dir``: where the disk
        path writes the folders the server loads (one of the server's ``--weights-dir`` folders); default a
        new temporary folder."""
        if weight_transfer not in WEIGHT_TRANSFERS:
            raise ValueError(f"weight_transfer={weight_transfer!r} is not one of {WEIGHT_TRANSFERS}")
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.url, timeout=timeout_s, headers=headers)
        self.base_model_path = base_model_path
        self.pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="http-engine")
        self.weights_dir = weights_dir
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._last_folder: Path | None = None
        self.weight_transfer = weight_transfer
        self.server_world_size = server_world_size
        self.broadcaster: WeightBroadcaster | None = None

    def _post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        response = self.http.post(path, json=body or {})
        response.raise_for_status()
        return response.json()

    def _one(self, request: GenerationRequest, sampling: SamplingParams) -> list[GenerationResult]:
        if request.multimodal_inputs:  # e.g. an external engine added to a multimodal run
            raise RelaxUserError(
                f"request {request.request_id!r} carries media, but the engine at {self.url} is driven over HTTP "
                "with token ids only: multimodal runs need rollout=torch engines"
            )
        body = {
            "input_ids": request.input_ids,
            "sampling_params": {
                "max_new_tokens": sampling.max_new_tokens,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k,
                "stop": sampling.stop_strings or None,
                "stop_token_ids": sampling.stop_token_ids or None,
                "ignore_eos": sampling.ignore_eos,
                "n": max(sampling.n, 1),
            },
            "return_logprob": True,
            "rid": request.request_id or None,
        }
        data = self._post("/generate", body)
        items = data if isinstance(data, list) else [data]
        results = []
        for item in items:
            meta = item.get("meta_info", {})
            pairs = meta.get("output_token_logprobs") or []
            ids = item.get("output_ids") or [p[1] for p in pairs]
            reason = (meta.get("finish_reason") or {}).get("type", "length")
            results.append(
                GenerationResult(
                    output_ids=list(ids),
                    logprobs=[float(p[0]) for p in pairs],
                    finish_reason=FINISH.get(reason, "stop"),
                    request_id=request.request_id,
                    weight_version=parse_weight_version(meta.get("weight_version"), self.weight_version),
                )
            )
        return results

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[GenerationResult]:
        futures = [self.pool.submit(self._one, r, sampling) for r in requests]
        return [res for f in futures for res in f.result()]

    def update_weights_from_disk(self, path: str, version: int) -> None:
        data = self._post("/update_weights_from_disk", {"model_path": path, "weight_version": str(version)})
        if not data.get("success", False):
            raise RuntimeError(f"{self.url} refused weights from {path}: {data.get('message')}")
        self.weight_version = version

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """In memory over the weight-transfer group (formed on the first update), or through a local folder
        the server reads (it shares the filesystem), per ``weight_transfer``."""
        if self.weight_transfer == "distributed":
            if self.broadcaster is None:
                self.broadcaster = WeightBroadcaster(self._post, server_world_size=self.server_world_size)
            self.broadcaster.send(state_dict, version)
            self.weight_version = version
            return
        if self.weights_dir is None and self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="relax-weights-")
        root = Path(self.weights_dir or self._tmp.name)  # type: ignore[union-attr]
        folder = save_weights_folder(state_dict, self.base_model_path, root / f"v{version}")
        self.update_weights_from_disk(str(folder), version)
        if self._last_folder is not None and self._last_folder != folder:
            shutil.rmtree(self._last_folder, ignore_errors=True)  # the server has loaded the new one
        self._last_folder = folder

    def pause(self) -> None:
        self._post("/pause_generation", {"mode": "in_place"})

    def resume(self) -> None:
        self._post("/continue_generation")

    def abort(self, request_ids: Collection[str] | None = None) -> None:
        if request_ids is None:
            self._post("/abort_request", {"abort_all": True})
        for rid in request_ids or ():
            self._post("/abort_request", {"rid": rid})

    def flush_cache(self) -> None:
        self._post("/flush_cache")

    def release_memory(self) -> None:
        """SGLang's ``/release_memory_occupation`` of the KV cache alone (weights stay)."""
        self._post("/release_memory_occupation", {"tags": ["kv_cache"]})

    def resume_memory(self) -> None:
        self._post("/resume_memory_occupation", {"tags": ["kv_cache"]})

    def health(self) -> bool:
        try:
            return self.http.get("/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def shutdown(self) -> None:
        if self.broadcaster is not None:
            self.broadcaster.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.http.close()
        if self._tmp is not None:
            self._tmp.cleanup()
