"""One HTTP client for every SGLang-compatible engine server: ours (``http_server``), SGLang, or a router.

It implements :class:`RolloutEngine`, so the Rollout role drives a remote server exactly like the
in-process engine: one ``POST /generate`` per prompt (its ``n`` samples share the server's prefill),
sent concurrently so the server batches them. Weights reach the server through one
:class:`~relax_core.weight_transfer.server_push.ServerPush`: in memory over a torch.distributed group
(``distributed``) or through a folder per version (``disk``).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import torch

from relax_core.engines.base import GenerationRequest, GenerationResult, RolloutEngine, SamplingParams
from relax_core.errors import RelaxUserError
from relax_core.weight_transfer.server_push import (
    SERVER_PUSHES,
    ServerPush,
    ServerSide,
    load_folder,
    server_push,
)

FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def parse_weight_version(value: Any, fallback: int) -> int:
    """A server's ``weight_version`` as an int; SGLang reports ``"default"`` before any update."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return fallback


class HttpEngine(RolloutEngine):
    """Client of one engine server at ``url`` (``http://host:port``)."""

    copies_weights = True

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
        """``weight_transfer``: the :data:`SERVER_PUSHES` name, ``distributed`` (in memory) or ``disk``;
        ``weights_dir``: where ``disk`` writes the folders the server loads (see :class:`ServerSide`)."""
        SERVER_PUSHES.load(weight_transfer)  # a name no push has fails here, not at the first update
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=self.url, timeout=timeout_s, headers=headers)
        self.pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="http-engine")
        self.weight_transfer = weight_transfer
        self.server_side = ServerSide(server_world_size, base_model_path, weights_dir)
        # built on the first update: a broadcast group forms only with a server that serves
        self.push: ServerPush | None = None

    def _post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        response = self.http.post(path, json=body or {})
        response.raise_for_status()
        return response.json()

    def media_fields(self, request: GenerationRequest) -> dict[str, Any]:
        """The ``/generate`` fields carrying ``request``'s media (engines that take media override this)."""
        # e.g. an external engine added to a multimodal run
        raise RelaxUserError(
            f"request {request.request_id!r} carries media, but the engine at {self.url} is driven over HTTP "
            "with token ids only: multimodal runs need rollout=torch engines"
        )

    def _one(self, request: GenerationRequest, sampling: SamplingParams) -> list[GenerationResult]:
        media = self.media_fields(request) if request.multimodal_inputs else {}
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
            **media,
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
        with self._naming_server():
            load_folder(self._post, path, version)
        self.weight_version = version

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        t = time.perf_counter()
        with self._naming_server():
            if self.push is None:
                self.push = server_push(self.weight_transfer, self._post, self.server_side)
            self.push.push(state_dict, version)
        self.weight_version = version
        self.sync_stats = {
            "weight_sync/bytes": float(sum(v.numel() * v.element_size() for v in state_dict.values())),
            "weight_sync/seconds": time.perf_counter() - t,
            "weight_sync/adapter_only": 0.0,
        }

    @contextmanager
    def _naming_server(self) -> Iterator[None]:
        """A server's refusal names the server (a run may drive several)."""
        try:
            yield
        except RuntimeError as err:
            raise RuntimeError(f"{self.url}: {err}") from err

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
        if self.push is not None:
            self.push.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.http.close()
