"""Helpers shared by the engine tests (a module, not conftest, so its name cannot clash across test dirs)."""

from __future__ import annotations

from pathlib import Path

import torch

from relax_core.engines.base import GenerationRequest, GenerationResult
from relax_core.engines.torch_engine import TorchEngine
from relax_models.loader import load_causal_lm


def make_engine(model_dir: Path, tokenizer, **kwargs) -> TorchEngine:
    model = load_causal_lm(str(model_dir))
    return TorchEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id], tokenizer=tokenizer, **kwargs)


PROMPTS = ["sort 31524:", "sort 9:", "hello there, sort 8080:", "x"]


def reqs(tokenizer, prompts=PROMPTS) -> list[GenerationRequest]:
    return [GenerationRequest(tokenizer(p).input_ids, f"r{i}") for i, p in enumerate(prompts)]


def check_ignore_eos(
    free: list[GenerationResult], fixed: list[GenerationResult], eos: int, budget: int
) -> None:
    """``free`` samples honour EOS and some stop at it; every ``fixed`` sample (``ignore_eos``) runs its whole
    budget, and some drew EOS on the way."""
    assert any(r.finish_reason == "stop" and r.output_ids[-1] == eos for r in free)
    assert {(r.finish_reason, len(r.output_ids)) for r in fixed} == {("length", budget)}
    assert any(eos in r.output_ids for r in fixed)


@torch.no_grad()
def greedy_loop(model, ids: list[int], steps: int, forward_kwargs=None) -> list[int]:
    """Argmax decoding re-running the whole sequence every step (no cache, no batching)."""
    ids = list(ids)
    start = len(ids)
    for _ in range(steps):
        x = torch.tensor([ids])
        kwargs = forward_kwargs(x) if forward_kwargs else {}
        ids.append(int(model(input_ids=x, **kwargs).logits[0, -1].argmax()))
    return ids[start:]
