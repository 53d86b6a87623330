"""A rollout engine wrapper that lets a weight swap land while the engine generates (async mode's
``mode.partial_rollout``); with no concurrent swap, as in colocate, it only adds a lock."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from relax_core.engines.base import GenerationRequest, GenerationResult, SamplingParams


class ResumableEngine:
    """Wraps a rollout engine so a weight swap can land while it generates.

    ``finish``: the swap waits for the in-flight ``generate`` call, whose samples keep the old version.
    ``abort``: the swap aborts it; the cut-short rows are resumed (prompt + partial response) on the new
    weights and tagged with the older version, the one that produced their first tokens.
    """

    def __init__(self, engine, partial_rollout: str) -> None:
        self.engine = engine
        self.partial_rollout = partial_rollout
        self._lock = threading.Lock()
        self._swap_pending = threading.Event()
        self.swaps = 0
        self.resumed = 0

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def _turn(self) -> threading.Lock:
        while self._swap_pending.is_set():  # let a waiting swap go first
            time.sleep(0.001)
        self._lock.acquire()
        return self._lock

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[GenerationResult]:
        lock = self._turn()
        try:
            results = self.engine.generate(requests, sampling)
        finally:
            lock.release()
        n = max(sampling.n, 1)
        while self.partial_rollout == "abort":
            todo = [i for i, r in enumerate(results) if r.finish_reason == "abort"]
            todo = [i for i in todo if len(results[i].output_ids) < sampling.max_new_tokens]
            if not todo:
                break
            budget = max(sampling.max_new_tokens - len(results[i].output_ids) for i in todo)
            resume = [
                GenerationRequest(
                    requests[i // n].input_ids + results[i].output_ids,
                    requests[i // n].request_id,
                    requests[i // n].multimodal_inputs,
                )
                for i in todo
            ]
            lock = self._turn()
            try:
                more = self.engine.generate(resume, replace(sampling, n=1, max_new_tokens=budget))
            finally:
                lock.release()
            self.resumed += len(todo)
            for i, extra in zip(todo, more, strict=True):
                old = results[i]
                room = sampling.max_new_tokens - len(old.output_ids)
                ids, lps = extra.output_ids[:room], extra.logprobs[:room]
                reason = extra.finish_reason if len(extra.output_ids) <= room else "length"
                results[i] = GenerationResult(
                    old.output_ids + ids,
                    old.logprobs + lps,
                    reason,
                    old.request_id,
                    # the version of the first token: old weights unless aborted before decoding began
                    min(old.weight_version, extra.weight_version) if old.output_ids else extra.weight_version,
                )
        return results

    def swap(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self._swapping(lambda: self.engine.update_weights(state_dict, version))

    def swap_from_disk(self, folder: str, version: int) -> None:
        """:meth:`swap` to the weights of an HF folder, which the engine (or its server) reads itself."""
        self._swapping(lambda: self.engine.update_weights_from_disk(folder, version))

    def _swapping(self, load: Callable[[], None]) -> None:
        self._swap_pending.set()
        try:
            while not self._lock.acquire(timeout=0.01):
                if self.partial_rollout == "abort":
                    self.engine.abort()
            try:
                load()
                self.swaps += 1
            finally:
                self._lock.release()
        finally:
            self._swap_pending.clear()
