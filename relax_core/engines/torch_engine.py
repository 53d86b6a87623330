"""Relax's own rollout engine: an HF causal LM decoded with a preallocated slot KV cache, on CPU or GPU.

Text models of the Qwen3 family run on a fast path that calls the model's own modules (norms, projections,
MLP, rotary embedding) but keeps K/V in preallocated tensors ``[layers, slots, kv_heads, T, head_dim]``:

- **continuous batching**: every live sample owns a slot; a finished sample frees its slot (the last live
  slot moves into it, so live slots stay ``0..R-1`` and attention reads a view, no gather) and a waiting
  request is prefilled into free slots before the next decode step;
- **one prefill per prompt**: the prompt's K/V is copied into the ``n`` slots of its samples;
- decode attention groups the ``G = heads / kv_heads`` query heads of one KV head as ``G`` query rows, so
  K/V is never repeated.

Multimodal families (Qwen3-VL, Qwen3-Omni) and other architectures take a static-batch path through the HF
forward with ``relax_models.families`` (pixel/audio kwargs and M-RoPE positions at prefill,
``decode_positions`` afterwards).

Every sampled token's log-prob is taken under the temperature-scaled distribution before top-k/top-p
(``log softmax(z / T)``), what ``relax_core.algorithms.logprobs.token_logprobs_and_entropy`` recomputes.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from relax_core.engines.base import GenerationRequest, GenerationResult, RolloutEngine, SamplingParams


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to −inf) tokens outside the top-k and outside the smallest nucleus with mass ≥ top_p."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token and its log-prob log softmax(z/T)[token] per row (greedy: argmax, T=1)."""
    logits = logits.float()
    if sampling.greedy:
        token = logits.argmax(-1)
        return token, torch.log_softmax(logits, -1).gather(-1, token.unsqueeze(-1)).squeeze(-1)
    scaled = logits / sampling.temperature
    logp = torch.log_softmax(scaled, -1)
    if sampling.top_k > 0 or sampling.top_p < 1.0:
        probs = filter_logits(scaled, sampling.top_k, sampling.top_p).softmax(-1)
    else:
        probs = logp.exp()
    token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return token, logp.gather(-1, token.unsqueeze(-1)).squeeze(-1)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 RMSNorm: normalise in fp32, scale by the weight in the input dtype."""
    normed = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def fast_path_supported(model: torch.nn.Module) -> bool:
    """Plain decoder-only Qwen3 (dense, bias-free, SiLU) text models run on the slot-cache path."""
    cfg = getattr(model, "config", None)
    return (
        type(model).__name__ == "Qwen3ForCausalLM"
        and not getattr(cfg, "attention_bias", False)
        and getattr(cfg, "hidden_act", "silu") == "silu"
        and not getattr(cfg, "use_sliding_window", False)
    )


@dataclass
class _Job:
    """One request with ``n`` samples; done when every sample has finished."""

    request: GenerationRequest
    sampling: SamplingParams
    results: list[GenerationResult | None] = field(default_factory=list)
    remaining: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    aborted: bool = False


class TorchEngine(RolloutEngine):
    """Batched sampling with a slot KV cache and continuous batching (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        pad_token_id: int,
        eos_token_ids: list[int],
        seed: int = 0,
        tokenizer: Any = None,
        family: str = "qwen3",
        max_running: int = 1024,
        dtype: torch.dtype | None = None,
    ):
        if dtype is not None:
            model = model.to(dtype)
        self.model = model.eval()
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.tokenizer = tokenizer
        self.family = family
        self.max_running = max_running
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.fast = fast_path_supported(model)
        self._abort = threading.Event()
        self._paused = threading.Event()
        self._lock = threading.RLock()  # one thread steps the engine at a time
        self._queue: deque[_Job] = deque()
        self._rows: list[dict[str, Any]] = []  # per live slot: job, sample index, pending token
        self._cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self._fused: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.peak_running = 0  # most samples decoded together so far (continuous-batching stat)
        if self.fast:
            cfg = model.config
            self.n_layers = cfg.num_hidden_layers
            self.n_heads = cfg.num_attention_heads
            self.n_kv = cfg.num_key_value_heads
            self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    # ------------------------------------------------------------------ public interface
    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[GenerationResult]:
        if not requests:
            return []
        self._abort.clear()
        if not self.fast or any(r.multimodal_inputs for r in requests):
            with self._lock:
                return self._generate_static(requests, sampling)
        jobs = [self.submit(r, sampling) for r in requests]
        self.run_until(jobs)
        return [res for job in jobs for res in job.results]  # type: ignore[misc]

    def submit(self, request: GenerationRequest, sampling: SamplingParams) -> _Job:
        """Queue one request; :meth:`step` (or :meth:`run_until`) admits and decodes it."""
        n = max(sampling.n, 1)
        job = _Job(request, sampling, [None] * n, n)
        if not self.fast or request.multimodal_inputs:
            # static path: run it now, in the caller's thread
            with self._lock:
                job.results = self._generate_static([request], sampling)
            job.remaining = 0
            job.done.set()
            return job
        if sampling.max_new_tokens <= 0:
            job.results = [GenerationResult([], [], "length", request.request_id, self.weight_version)] * n
            job.remaining = 0
            job.done.set()
            return job
        with self._lock:
            self._queue.append(job)
        return job

    def run_until(self, jobs: list[_Job]) -> None:
        while not all(j.done.is_set() for j in jobs):
            if not self.step():
                # nothing to do in this thread (another thread owns the work): wait for it
                for j in jobs:
                    j.done.wait(0.01)

    def has_work(self) -> bool:
        return bool(self._queue or self._rows)

    def num_running(self) -> int:
        return len(self._rows) + sum(j.remaining for j in self._queue)

    @torch.no_grad()
    def step(self) -> bool:
        """Admit waiting requests into free slots, then decode one token for every live slot."""
        with self._lock:
            if self._abort.is_set():
                self._abort_all()
                self._abort.clear()
                return True
            if not self._paused.is_set():
                self._admit()
            if not self._rows:
                return False
            self._decode()
            return True

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        with self._lock:
            self.model.load_state_dict(state_dict, strict=False)
            self._fused = None
            self.weight_version = version

    def pause(self) -> None:
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    def abort(self) -> None:
        self._abort.set()

    def flush_cache(self) -> None:
        with self._lock:
            if not self._rows:
                self._cache = None

    # ------------------------------------------------------------------ slot cache
    def _ensure_cache(self, slots: int, length: int) -> None:
        """Grow the preallocated K/V tensors to at least ``slots`` x ``length`` (copying live rows)."""
        if self._cache is not None:
            k, _ = self._cache
            if k.shape[1] >= slots and k.shape[3] >= length:
                return
            slots, length = max(slots, k.shape[1]), max(length, k.shape[3])
        slots = max(slots, 8)
        length = ((length + 63) // 64) * 64
        dtype = next(self.model.parameters()).dtype
        shape = (self.n_layers, slots, self.n_kv, length, self.head_dim)
        # zeros, not empty: unwritten positions are masked, and 0 * (stale NaN bits) would still be NaN
        new_k = torch.zeros(shape, dtype=dtype, device=self.device)
        new_v = torch.zeros(shape, dtype=dtype, device=self.device)
        if self._cache is not None and self._rows:
            old_k, old_v = self._cache
            r, t = len(self._rows), old_k.shape[3]
            new_k[:, :r, :, :t] = old_k[:, :r]
            new_v[:, :r, :, :t] = old_v[:, :r]
        self._cache = (new_k, new_v)

    def _stop_ids(self, sampling: SamplingParams) -> list[int]:
        return self.eos_token_ids + list(sampling.stop_token_ids)

    def _admit(self) -> None:
        """Prefill as many waiting jobs as fit in free slots, in one batched forward."""
        free = self.max_running - len(self._rows)
        batch: list[_Job] = []
        while self._queue and (self._queue[0].remaining <= free or not self._rows and not batch):
            job = self._queue.popleft()
            free -= job.remaining
            batch.append(job)
        if not batch:
            return
        prompts = [j.request.input_ids for j in batch]
        lens = torch.tensor([len(p) for p in prompts], device=self.device)
        width = int(lens.max())
        need_len = max(len(j.request.input_ids) + j.sampling.max_new_tokens for j in batch)
        need_len = max(need_len, max((r["limit"] for r in self._rows), default=0))
        self._ensure_cache(len(self._rows) + sum(j.remaining for j in batch), need_len)
        ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        positions = torch.arange(width, device=self.device).expand(len(batch), -1)
        key_ok = positions < lens.unsqueeze(1)
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        mask = causal.unsqueeze(0) & key_ok.unsqueeze(1)  # [P, q, k]
        # each job's slots, in order
        slots, owners = [], []
        base = len(self._rows)
        for i, job in enumerate(batch):
            for s in range(job.remaining):
                slots.append(base + len(slots))
                owners.append((i, s))
        src = torch.tensor([o[0] for o in owners], device=self.device)
        dst = torch.tensor(slots, device=self.device)
        hidden = self._prefill(ids, positions, mask.unsqueeze(1), width, src, dst)
        last = hidden[torch.arange(len(batch)), lens - 1]
        logits = self.model.lm_head(self.model.model.norm(last))
        for i, job in enumerate(batch):
            n = job.remaining
            rows = logits[i : i + 1].expand(n, -1)
            token, logp = sample_tokens(rows, job.sampling, self.generator)
            stop = self._stop_ids(job.sampling)
            for s in range(n):
                row = {
                    "job": job,
                    "index": s,
                    "len": len(job.request.input_ids),
                    "limit": len(job.request.input_ids) + job.sampling.max_new_tokens,
                    "tokens": [],
                    "logprobs": [],
                    "stop": stop,
                }
                self._rows.append(row)
                self._emit(row, int(token[s]), float(logp[s]))
        self.peak_running = max(self.peak_running, len(self._rows))
        self._retire()

    def _attn_qkv(self, layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

        attn = layer.self_attn
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = attn.q_norm(attn.q_proj(x).view(shape)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(x).view(shape)).transpose(1, 2)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return attn, q, k, v

    def _prefill(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        width: int,
        src: torch.Tensor,
        dst: torch.Tensor,
    ) -> torch.Tensor:
        """Full causal forward of right-padded prompts; K/V of prompt ``src[j]`` lands in slot ``dst[j]``."""
        inner = self.model.model
        h = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(h, positions)
        k_cache, v_cache = self._cache  # type: ignore[misc]
        groups = self.n_heads // self.n_kv
        for li, layer in enumerate(inner.layers):
            x = layer.input_layernorm(h)
            attn, q, k, v = self._attn_qkv(layer, x, cos, sin)
            k_cache[li, dst, :, :width] = k[src]
            v_cache[li, dst, :, :width] = v[src]
            kk = k.repeat_interleave(groups, dim=1) if groups > 1 else k
            vv = v.repeat_interleave(groups, dim=1) if groups > 1 else v
            o = torch.nn.functional.scaled_dot_product_attention(
                q, kk, vv, attn_mask=mask, scale=attn.scaling
            )
            h = h + attn.o_proj(o.transpose(1, 2).reshape(*h.shape[:-1], -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h

    def _fused_weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer: [q;k;v] and [gate;up] projection weights stacked, so decode runs 4 matmuls a layer."""
        if self._fused is None:
            self._fused = []
            for layer in self.model.model.layers:
                a, mlp = layer.self_attn, layer.mlp
                qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
                self._fused.append((qkv, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])))
        return self._fused

    def _decode(self) -> None:
        """Feed every live slot's pending token at its next position, sample the next one.

        Same math as the HF modules (RMSNorm in fp32, rotary from the model's own ``rotary_emb``, softmax
        attention over the slot's cached keys), with fused projections and in-place cache writes.
        """
        inner = self.model.model
        rows = self._rows
        r = len(rows)
        n_h, n_kv, d = self.n_heads, self.n_kv, self.head_dim
        groups = n_h // n_kv
        tokens = torch.tensor([row["pending"] for row in rows], device=self.device)
        lens = torch.tensor([row["len"] for row in rows], device=self.device)
        span = int(lens.max()) + 1
        h = inner.embed_tokens(tokens)  # [R, hidden]
        cos, sin = inner.rotary_emb(h.unsqueeze(1), lens.unsqueeze(1))  # [R, 1, D]
        k_cache, v_cache = self._cache  # type: ignore[misc]
        t_cap = k_cache.shape[3]
        heads = torch.arange(n_kv, device=self.device)
        ar = torch.arange(r, device=self.device)
        flat_idx = (((ar * n_kv).unsqueeze(1) + heads) * t_cap + lens.unsqueeze(1)).reshape(-1)
        mask = torch.zeros((r, 1, 1, span), dtype=torch.float32, device=self.device)
        mask.masked_fill_(
            torch.arange(span, device=self.device).view(1, 1, 1, span) > lens.view(r, 1, 1, 1), float("-inf")
        )
        eps = self.model.config.rms_norm_eps
        for li, (layer, (w_qkv, w_gu)) in enumerate(zip(inner.layers, self._fused_weights())):
            attn = layer.self_attn
            qkv = torch.nn.functional.linear(_rms(h, layer.input_layernorm.weight, eps), w_qkv)
            q = _rms(qkv[:, : n_h * d].view(r, n_h, d), attn.q_norm.weight, eps)
            k = _rms(qkv[:, n_h * d : (n_h + n_kv) * d].view(r, n_kv, d), attn.k_norm.weight, eps)
            v = qkv[:, (n_h + n_kv) * d :].reshape(r * n_kv, d)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k_cache[li].view(-1, d).index_copy_(0, flat_idx, k.reshape(r * n_kv, d))
            v_cache[li].view(-1, d).index_copy_(0, flat_idx, v)
            keys, values = k_cache[li, :r, :, :span], v_cache[li, :r, :, :span]  # [R, Hkv, span, D] views
            scores = torch.matmul(q.view(r, n_kv, groups, d), keys.transpose(-1, -2)) * attn.scaling
            probs = torch.softmax(scores.float() + mask, dim=-1).to(values.dtype)
            o = torch.matmul(probs, values).reshape(r, n_h * d)
            h = h + torch.nn.functional.linear(o, attn.o_proj.weight)
            gate, up = torch.nn.functional.linear(
                _rms(h, layer.post_attention_layernorm.weight, eps), w_gu
            ).chunk(2, dim=-1)
            h = h + torch.nn.functional.linear(
                torch.nn.functional.silu(gate) * up, layer.mlp.down_proj.weight
            )
        logits = self.model.lm_head(_rms(h, inner.norm.weight, eps))
        for row in rows:
            row["len"] += 1
        # sample per distinct sampling config (usually one)
        by_cfg: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            by_cfg.setdefault(id(row["job"].sampling), []).append(i)
        for idx in by_cfg.values():
            sampling = rows[idx[0]]["job"].sampling
            sel = logits if len(idx) == r else logits[torch.tensor(idx, device=self.device)]
            token, logp = sample_tokens(sel, sampling, self.generator)
            for i, tok, lp in zip(idx, token.tolist(), logp.tolist()):
                self._emit(rows[i], tok, lp)
        self._retire()

    def _emit(self, row: dict[str, Any], token: int, logp: float) -> None:
        """Record one sampled token; mark the row finished on a stop token/string or the budget."""
        row["tokens"].append(token)
        row["logprobs"].append(logp)
        row["pending"] = token
        sampling: SamplingParams = row["job"].sampling
        if token in row["stop"]:
            row["finish"] = "stop"
        elif sampling.stop_strings and self.tokenizer is not None:
            tail = self.tokenizer.decode(row["tokens"][-16:])
            if any(s in tail for s in sampling.stop_strings):
                row["finish"] = "stop"
        if "finish" not in row and len(row["tokens"]) >= sampling.max_new_tokens:
            row["finish"] = "length"

    def _retire(self, reason: str | None = None) -> None:
        """Move finished rows out; the last live slot fills each hole so live slots stay 0..R-1."""
        i = 0
        k_cache, v_cache = self._cache  # type: ignore[misc]
        while i < len(self._rows):
            row = self._rows[i]
            if reason is not None:
                row.setdefault("finish", reason)
            if "finish" not in row:
                i += 1
                continue
            job: _Job = row["job"]
            job.results[row["index"]] = GenerationResult(
                output_ids=row["tokens"],
                logprobs=row["logprobs"],
                finish_reason=row["finish"],
                request_id=job.request.request_id,
                weight_version=self.weight_version,
            )
            job.remaining -= 1
            if job.remaining == 0:
                job.done.set()
            last = len(self._rows) - 1
            if i != last:
                k_cache[:, i] = k_cache[:, last]
                v_cache[:, i] = v_cache[:, last]
                self._rows[i] = self._rows[last]
            self._rows.pop()

    def _abort_all(self) -> None:
        """Finish live rows with ``abort`` (tokens so far kept) and answer queued jobs with empty aborts."""
        if self._rows:
            self._retire("abort")
        while self._queue:
            job = self._queue.popleft()
            job.results = [
                GenerationResult([], [], "abort", job.request.request_id, self.weight_version)
                for _ in job.results
            ]
            job.remaining = 0
            job.done.set()

    # ------------------------------------------------------------------ static path (multimodal, other archs)
    def _generate_static(
        self, requests: list[GenerationRequest], sampling: SamplingParams
    ) -> list[GenerationResult]:
        """Left-padded batch through the HF forward with an HF cache; multimodal kwargs + M-RoPE positions."""
        from relax_models.families import decode_positions, forward_kwargs, rope_positions

        with torch.no_grad():
            n = max(sampling.n, 1)
            prompts = [r.input_ids for r in requests]
            width = max(len(p) for p in prompts)
            ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(prompts), width), dtype=torch.long)
            for i, p in enumerate(prompts):
                ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
                mask[i, width - len(p) :] = 1
            ids, mask = ids.to(self.device), mask.to(self.device)
            mm = [r.multimodal_inputs for r in requests]
            kw = forward_kwargs(self.family, mm, input_ids=ids, config=self.model.config, device=self.device)
            positions, deltas = rope_positions(self.family, self.model, ids, mask, kw)
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **kw)
            cache, logits = out.past_key_values, out.logits[:, -1, :]
            next_index = mask.sum(-1)
            if n > 1:  # one prefill per prompt, n decoding rows per prompt
                cache.batch_repeat_interleave(n)
                logits = logits.repeat_interleave(n, 0)
                mask = mask.repeat_interleave(n, 0)
                deltas = deltas.repeat_interleave(n, 0)
                next_index = next_index.repeat_interleave(n, 0)
            rows = logits.shape[0]
            stop_ids = torch.tensor(self._stop_ids(sampling), device=self.device)
            steps = max(sampling.max_new_tokens, 0)
            tokens = torch.zeros((rows, steps), dtype=torch.long, device=self.device)
            logprobs = torch.zeros((rows, steps), device=self.device)
            lengths = torch.zeros(rows, dtype=torch.long, device=self.device)
            done = torch.zeros(rows, dtype=torch.bool, device=self.device)
            stopped = torch.zeros(rows, dtype=torch.bool, device=self.device)
            for t in range(steps):
                token, logprob = sample_tokens(logits, sampling, self.generator)
                token = torch.where(done, torch.full_like(token, self.pad_token_id), token)
                tokens[:, t], logprobs[:, t] = token, logprob
                lengths += (~done).long()
                hit_stop = torch.isin(token, stop_ids) & ~done
                if sampling.stop_strings and self.tokenizer is not None:
                    for row in range(rows):
                        if not done[row]:
                            tail = self.tokenizer.decode(tokens[row, max(0, t - 15) : t + 1].tolist())
                            if any(s in tail for s in sampling.stop_strings):
                                hit_stop[row] = True
                stopped |= hit_stop
                done |= hit_stop
                if bool(done.all()) or self._abort.is_set() or t == steps - 1:
                    break
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                out = self.model(
                    input_ids=token.unsqueeze(1),
                    attention_mask=mask,
                    position_ids=decode_positions(self.family, next_index, deltas),
                    past_key_values=cache,
                    use_cache=True,
                )
                cache, logits = out.past_key_values, out.logits[:, -1, :]
                next_index = next_index + 1
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
