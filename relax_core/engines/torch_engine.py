"""Relax's own rollout engine: an HF causal LM decoded with a KV cache, on CPU or GPU.

Prompts are left-padded and prefilled once; the cache is then repeated for the ``n`` samples of each
prompt, so a group shares one prefill. Each step samples every live row (temperature, top-k, top-p),
records the log-prob of the sampled token under the temperature-scaled distribution, and retires rows
that emit a stop token.
"""

from __future__ import annotations

import threading

import torch

from relax_core.engines.base import GenerationRequest, GenerationResult, RolloutEngine, SamplingParams


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to −inf) tokens outside the top-k and outside the smallest nucleus with mass ≥ top_p."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class TorchEngine(RolloutEngine):
    def __init__(self, model: torch.nn.Module, pad_token_id: int, eos_token_ids: list[int], seed: int = 0):
        self.model = model.eval()
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._abort = threading.Event()

    @torch.no_grad()
    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[GenerationResult]:
        if not requests:
            return []
        self._abort.clear()
        n = max(sampling.n, 1)
        prompts = [r.input_ids for r in requests]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1, :]
        if n > 1:  # one prefill per prompt, n decoding rows per prompt
            cache.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, 0)
            mask = mask.repeat_interleave(n, 0)
            positions = positions.repeat_interleave(n, 0)
        rows = logits.shape[0]
        next_pos = positions[:, -1] + 1
        stop_ids = torch.tensor(self.eos_token_ids + sampling.stop_token_ids, device=self.device)
        tokens = torch.zeros((rows, sampling.max_new_tokens), dtype=torch.long, device=self.device)
        logprobs = torch.zeros((rows, sampling.max_new_tokens), device=self.device)
        lengths = torch.zeros(rows, dtype=torch.long, device=self.device)
        done = torch.zeros(rows, dtype=torch.bool, device=self.device)
        stopped = torch.zeros(rows, dtype=torch.bool, device=self.device)
        for t in range(sampling.max_new_tokens):
            token, logprob = self._sample(logits.float(), sampling)
            token = torch.where(done, torch.full_like(token, self.pad_token_id), token)
            tokens[:, t], logprobs[:, t] = token, logprob
            lengths += (~done).long()
            hit_stop = torch.isin(token, stop_ids) & ~done
            stopped |= hit_stop
            done |= hit_stop
            if bool(done.all()) or self._abort.is_set() or t == sampling.max_new_tokens - 1:
                break
            mask = torch.cat([mask, (~done).long().unsqueeze(1)], dim=1)
            out = self.model(
                input_ids=token.unsqueeze(1),
                attention_mask=mask,
                position_ids=next_pos.unsqueeze(1),
                past_key_values=cache,
                use_cache=True,
            )
            cache, logits = out.past_key_values, out.logits[:, -1, :]
            next_pos = next_pos + 1
        aborted = self._abort.is_set()
        results = []
        for row in range(rows):
            length = int(lengths[row])
            reason = "stop" if stopped[row] else ("abort" if aborted else "length")
            results.append(
                GenerationResult(
                    output_ids=tokens[row, :length].tolist(),
                    logprobs=logprobs[row, :length].tolist(),
                    finish_reason=reason,
                    request_id=requests[row // n].request_id,
                    weight_version=self.weight_version,
                )
            )
        return results

    def _sample(self, logits: torch.Tensor, sampling: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        if sampling.greedy:
            token = logits.argmax(-1)
            return token, torch.log_softmax(logits, -1).gather(-1, token.unsqueeze(-1)).squeeze(-1)
        scaled = logits / sampling.temperature
        logp = torch.log_softmax(scaled, -1)
        filtered = filter_logits(scaled, sampling.top_k, sampling.top_p)
        token = torch.multinomial(filtered.softmax(-1), 1, generator=self.generator).squeeze(-1)
        return token, logp.gather(-1, token.unsqueeze(-1)).squeeze(-1)

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self.model.load_state_dict(state_dict, strict=False)
        self.weight_version = version

    def abort(self) -> None:
        self._abort.set()
