"""Relax's own rollout engine: an HF causal LM decoded with a preallocated slot KV cache, on CPU or GPU.

Text models of the Qwen3 family run on a fast path that calls the model's own modules (norms, projections,
MLP, rotary embedding) but keeps K/V in preallocated tensors ``[layers, slots, kv_heads, T, head_dim]``:

- **continuous batching**: every live sample owns a slot; a finished sample frees its slot (the last live
  slot moves into it, so live slots stay ``0..R-1`` and attention reads a view, no gather) and a waiting
  request is prefilled into free slots before the next decode step;
- **one prefill per prompt**: the prompt's K/V is copied into the ``n`` slots of its samples;
- decode attention groups the ``G = heads / kv_heads`` query heads of one KV head as ``G`` query rows, so
  K/V is never repeated.

**Token budget** (``kv_cache_tokens``, ``rollout.kv_cache_tokens``): the cache holds at most that many
tokens. Every slot is as long as the longest live prompt + ``max_new_tokens``, so a request's ``n`` samples
are admitted only while (live + waiting-to-admit + ``n``) slots of that length fit; the rest wait in the
queue. A request whose ``n`` samples could never fit is refused. Admission order is the queue's, so greedy
generations are the same with or without a budget. :meth:`TorchEngine.release_memory` frees the cache and
the decode buffers between generations (colocate, while the trainer steps); the next admission re-creates
them.

Multimodal families (Qwen3-VL, Qwen3-Omni) and other architectures take a static-batch path through the HF
forward with ``relax_models.families`` (pixel/audio kwargs and M-RoPE positions at prefill,
``decode_positions`` afterwards).

Every sampled token's log-prob is taken under the temperature-scaled distribution before top-k/top-p
(``log softmax(z / T)``), what ``relax_core.algorithms.logprobs.token_logprobs_and_entropy`` recomputes.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import threading
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from relax_core.engines.base import (
    EngineSetup,
    GenerationRequest,
    GenerationResult,
    RolloutEngine,
    SamplingParams,
    engine_dtype,
)
from relax_core.errors import RelaxUserError

if TYPE_CHECKING:
    from relax_core.config.schema import RolloutConfig


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to −inf) tokens outside the top-k and outside the smallest nucleus with mass ≥ top_p."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p; the top token always stays, also for a
        # top_p below float32's range, which the comparison rounds to 0 (it would drop every token)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None, kernels: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token and its log-prob log softmax(z/T)[token] per row (greedy: argmax, T=1).

    Sampling is by inverse CDF with one uniform u per row: the token is the first whose running sum of
    w = exp(z/T - max z/T) (zero outside top-k/top-p) exceeds u · sum w. One uniform per row instead of one
    per logit (Gumbel-max, ``torch.multinomial``) is what makes it cheap on CPU. ``kernels`` (the native decode
    kernels) sample an unfiltered row in one pass from the same uniform and with the same exp, so from equal
    logits both paths pick the same token."""
    logits = logits.float()
    if sampling.greedy:
        token = logits.argmax(-1)
        return token, torch.log_softmax(logits, -1).gather(-1, token.unsqueeze(-1)).squeeze(-1)
    scaled = logits if sampling.temperature == 1.0 else logits / sampling.temperature
    uniforms = torch.rand(scaled.shape[0], generator=generator, device=scaled.device)
    filtered = sampling.top_k > 0 or sampling.top_p < 1.0
    if kernels is not None and not filtered:
        token, logp = kernels.sample_rows(scaled, uniforms)
        return token, logp
    kept = filter_logits(scaled, sampling.top_k, sampling.top_p) if filtered else scaled
    cdf = (kept - scaled.amax(-1, keepdim=True)).exp_().cumsum(-1)  # cumsum accumulates in double
    # u < 1 keeps u · total below total in float, so some running sum exceeds it, at a token with weight
    token = torch.searchsorted(cdf, uniforms.unsqueeze(-1) * cdf[:, -1:], right=True).squeeze(-1)
    return token, torch.log_softmax(scaled, -1).gather(-1, token.unsqueeze(-1)).squeeze(-1)


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in one fused op (Qwen3 normalises in fp32; the op accumulates in fp32)."""
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding ``x cos + rotate_half(x) sin``, with rotate_half = roll by half times ``[-1, +1]``
    (the sign is folded into ``sin_signed``), so it is three ops."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)


def _zeros_in_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on a Linux CPU in its own anonymous mapping advised for transparent huge pages.

    Every decode step streams the whole live slot cache, one short run of positions per (slot, KV head);
    with 4 KiB pages that is a TLB miss every few runs, with 2 MiB pages almost none (attention ~10% faster
    when the cache is larger than the CPU's caches). The kernel hands the mapping out zeroed.
    """
    if device.type != "cpu" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    region = mmap.mmap(-1, max(count * dtype.itemsize, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=dtype, count=count).view(shape)


@dataclass
class _LayerWeights:
    """One decoder layer laid out for the decode step: fused projections, transposed outputs for addmm."""

    input_norm: torch.Tensor
    qkv: torch.Tensor  # [q; k; v] projection rows
    qk_norm: torch.Tensor  # [heads + kv_heads, head_dim]: q_norm x attention scaling, then k_norm
    o_t: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [gate; up] projection rows
    down_t: torch.Tensor


def _layer_weights(
    layer: torch.nn.Module, n_heads: int, n_kv: int, qk_norm_dtype: torch.dtype | None = None
) -> _LayerWeights:
    a, mlp = layer.self_attn, layer.mlp
    # folding the score scaling into q's norm weight saves one op on the scores per layer
    qk_norm = torch.cat([(a.q_norm.weight * a.scaling).expand(n_heads, -1), a.k_norm.weight.expand(n_kv, -1)])
    qk_norm = qk_norm if qk_norm_dtype is None else qk_norm.to(qk_norm_dtype)
    return _LayerWeights(
        input_norm=layer.input_layernorm.weight,
        qkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
        qk_norm=qk_norm,
        o_t=a.o_proj.weight.t(),
        post_norm=layer.post_attention_layernorm.weight,
        gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
        down_t=mlp.down_proj.weight.t(),
    )


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
    error: str | None = None  # why the engine could not run it (the job is done, without results)


class _SlotState:
    """Per-slot decode state as tensors (row ``i`` is live slot ``i``), so a decode step records tokens and
    finds finished samples with a few tensor ops instead of Python per sample."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.lens = torch.zeros(0, dtype=torch.long, device=device)  # position of the pending token
        self.pending = torch.zeros(0, dtype=torch.long, device=device)  # token fed at the next step
        self.count = torch.zeros(0, dtype=torch.long, device=device)  # tokens sampled so far
        self.budget = torch.zeros(0, dtype=torch.long, device=device)  # max_new_tokens
        self.tokens = torch.zeros(0, 0, dtype=torch.long, device=device)  # sampled tokens
        self.logprobs = torch.zeros(0, 0, device=device)  # their log-probs
        self.stops = torch.zeros(0, 0, dtype=torch.long, device=device)  # stop token ids, -1 padded
        self.prompt = torch.zeros(0, dtype=torch.long, device=device)  # which admitted prompt (any unique id)

    def ensure(self, slots: int, width: int, n_stops: int, live: int) -> None:
        """At least ``slots`` rows, ``width`` tokens per row and ``n_stops`` stop ids, keeping live rows."""
        slots = max(slots, self.lens.shape[0])

        def grown(t: torch.Tensor, *cols: int, fill: int = 0) -> torch.Tensor:
            shape = (slots, *(max(c, old) for c, old in zip(cols, t.shape[1:])))
            if tuple(t.shape) == shape:
                return t
            new = torch.full(shape, fill, dtype=t.dtype, device=self.device)
            new[(slice(0, live), *(slice(0, old) for old in t.shape[1:]))] = t[:live]
            return new

        self.lens, self.pending = grown(self.lens), grown(self.pending)
        self.count, self.budget = grown(self.count), grown(self.budget)
        self.tokens, self.logprobs = grown(self.tokens, width), grown(self.logprobs, width)
        self.stops = grown(self.stops, n_stops, fill=-1)
        self.prompt = grown(self.prompt)

    def start(self, slots: slice, prompt: int, prompt_len: int, budget: int, stops: list[int]) -> None:
        """New samples of prompt number ``prompt`` in ``slots``: the prompt's length, no tokens yet."""
        self.lens[slots], self.count[slots], self.budget[slots] = prompt_len, 0, budget
        self.prompt[slots] = prompt
        self.stops[slots] = -1
        self.stops[slots, : len(stops)] = torch.tensor(stops, dtype=torch.long, device=self.device)

    def record(
        self, rows: slice, token: torch.Tensor, logp: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append one sampled token per row of ``rows``; which rows hit a stop id, which used their budget."""
        count = self.count[rows]
        self.tokens[rows].scatter_(1, count.unsqueeze(1), token.unsqueeze(1))
        self.logprobs[rows].scatter_(1, count.unsqueeze(1), logp.to(self.logprobs.dtype).unsqueeze(1))
        count += 1
        self.pending[rows] = token
        return (token.unsqueeze(1) == self.stops[rows]).any(1), count >= self.budget[rows]

    def outputs(self, slots: list[int]) -> list[tuple[list[int], list[float]]]:
        """Each slot's sampled tokens and log-probs, read out in one pass for all ``slots``."""
        index = torch.tensor(slots, device=self.device)
        counts = self.count[index].tolist()
        tokens, logprobs = self.tokens[index].tolist(), self.logprobs[index].tolist()
        return [(ids[:n], lps[:n]) for n, ids, lps in zip(counts, tokens, logprobs)]

    def move(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        for t in (
            self.lens,
            self.pending,
            self.count,
            self.budget,
            self.tokens,
            self.logprobs,
            self.stops,
            self.prompt,
        ):
            t[dst] = t[src]

    def shared_prompts(self, live: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per live slot, the first live slot with the same prompt and the prompt's length: the cache rows
        the two hold alike (the prefill wrote the prompt's keys and values into every sample's slot)."""
        index = torch.arange(live, device=self.device)
        _, prompt = torch.unique(self.prompt[:live], return_inverse=True)
        first = torch.full((int(prompt.max()) + 1,), live, device=self.device)
        first.scatter_reduce_(0, prompt, index, "amin")
        return first[prompt], self.prompt_lens(live)

    def prompt_lens(self, live: int) -> torch.Tensor:
        """Each live slot's prompt length (``lens`` is the prompt plus the tokens sampled, minus one)."""
        return (self.lens - self.count + 1)[:live]


class TorchEngine(RolloutEngine):
    """Batched sampling with a slot KV cache and continuous batching (see the module docstring)."""

    @classmethod
    def check_media(cls, media: list[str], rollout: RolloutConfig, modality: str) -> None:
        """Every kind: the processor's tensors go into the model as they go into the trainer's."""

    @classmethod
    def from_config(cls, setup: EngineSetup) -> TorchEngine:
        """The policy of ``setup.model_path`` loaded in this process, on its role's device, sampling as
        ``rollout.*`` describes."""
        from transformers import AutoConfig

        from relax_core.config.schema import ModelConfig
        from relax_core.runtime.placement import role_device
        from relax_models.families import FAMILIES, family_for_model_type
        from relax_models.loader import DTYPES

        r, model_cfg = setup.rollout_config(), setup.model or ModelConfig()
        family = family_for_model_type(AutoConfig.from_pretrained(setup.model_path).model_type)
        model = FAMILIES[family].load(
            setup.model_path, DTYPES[model_cfg.dtype], model_cfg.attn_implementation
        )
        tokenizer = setup.tokenizer
        return cls(
            model.to(role_device()),  # the engine decodes on its model's device
            tokenizer.pad_token_id,
            [tokenizer.eos_token_id],
            seed=setup.seed,
            tokenizer=tokenizer,
            family=family,
            max_running=r.max_running,
            dtype=engine_dtype(r.dtype) if setup.rollout is not None else None,
            native_kernels=r.native_kernels,
            record_routing=setup.record_routing,
            kv_cache_tokens=r.kv_cache_tokens,
        )

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
        native_kernels: bool = False,
        record_routing: bool = False,
        kv_cache_tokens: int | None = None,
    ):
        if dtype is not None:
            model = model.to(dtype)
        self.model = model.eval()
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.tokenizer = tokenizer
        self.family = family
        self.max_running = max_running
        self.kv_cache_tokens = kv_cache_tokens  # None: no bound (max_running slots x the longest row)
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.fast = fast_path_supported(model)
        # algorithm.routing_replay: results carry each token's MoE expert indices (MoE models take the static
        # path, whose HF forward the recording hooks into)
        self.record_routing = record_routing
        self._abort = threading.Event()
        self._abort_ids: set[str] | None = None  # None: abort everything
        self._abort_lock = threading.Lock()  # not self._lock: an abort must not wait for a long generation
        self._paused = threading.Event()
        self._lock = threading.RLock()  # one thread steps the engine at a time
        self._queue: deque[_Job] = deque()
        self._rows: list[dict[str, Any]] = []  # per live slot: job, sample index (and finish)
        # id(sampling) -> [sampling, live rows]: the configs a decode step draws with, without a pass over rows
        self._live_configs: dict[int, list[Any]] = {}
        self._slots = _SlotState(self.device)  # the live slots' tokens, positions and stop tests
        self._admitting: list[_Job] = []  # jobs taken off the queue by the prefill in progress
        self._cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rotary: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, signed sin per cache position
        self._positions = torch.arange(0)
        self._layer_weights: list[_LayerWeights] | None = None
        self._scratch_buffers: dict[str, torch.Tensor] = {}  # the native decode's projection outputs
        self._prompts_admitted = 0  # numbers each admitted prompt, so its samples' slots can be matched
        self._shared: tuple[torch.Tensor, torch.Tensor] | None = None  # per live slot: the prompt rows' owner
        self.peak_running = 0  # most samples decoded together so far (continuous-batching stat)
        if self.fast:
            cfg = model.config
            self.n_layers = cfg.num_hidden_layers
            self.n_heads = cfg.num_attention_heads
            self.n_kv = cfg.num_key_value_heads
            self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.kernels = self._native_kernels() if native_kernels else None

    def _native_kernels(self) -> Any:
        """The fused decode kernels (:mod:`relax_core.engines.native_decode`), for the fp32 or bf16 CPU text
        path."""
        from relax_core.engines.native_decode import KERNEL_HEAD_DIMS, KERNEL_MAX_GROUP, decode_kernels

        dtype = next(self.model.parameters()).dtype
        if not self.fast or dtype not in (torch.float32, torch.bfloat16) or self.device.type != "cpu":
            raise RelaxUserError(
                "rollout.native_kernels=true runs the fp32 or bf16 CPU decode of text Qwen3 models; this engine has "
                f"{type(self.model).__name__} in {dtype} on {self.device.type}"
            )
        if self.head_dim not in KERNEL_HEAD_DIMS or self.n_heads // self.n_kv > KERNEL_MAX_GROUP:
            raise RelaxUserError(
                f"rollout.native_kernels=true is compiled for head_dim {KERNEL_HEAD_DIMS} and at most "
                f"{KERNEL_MAX_GROUP} query heads per KV head; this model has head_dim {self.head_dim} and "
                f"{self.n_heads // self.n_kv}"
            )
        return decode_kernels()

    # ------------------------------------------------------------------ public interface
    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[GenerationResult]:
        if not requests:
            return []
        self._abort.clear()
        if not self.fast or any(r.multimodal_inputs for r in requests):
            with self._lock:
                return self._generate_static(requests, sampling)
        for request in requests:  # refuse before queueing any of them
            self._check_fits(request, sampling)
        jobs = [self.submit(r, sampling) for r in requests]
        self.run_until(jobs)
        failed = next((job.error for job in jobs if job.error), None)
        if failed is not None:  # a step run by another thread failed on these jobs
            raise RuntimeError(f"generation failed: {failed}")
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
        self._check_fits(request, sampling)
        with self._lock:
            self._queue.append(job)
        return job

    def _check_fits(self, request: GenerationRequest, sampling: SamplingParams) -> None:
        """RelaxUserError when the request's samples alone exceed the KV-cache token budget."""
        n, need = max(sampling.n, 1), len(request.input_ids) + sampling.max_new_tokens
        if self.kv_cache_tokens is not None and n * need > self.kv_cache_tokens:
            raise RelaxUserError(
                f"rollout.kv_cache_tokens={self.kv_cache_tokens} cannot hold request {request.request_id!r}: "
                f"{n} samples x ({len(request.input_ids)} prompt + {sampling.max_new_tokens} new tokens) = "
                f"{n * need} tokens; raise rollout.kv_cache_tokens or lower rollout.max_new_tokens"
            )

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

    @torch.inference_mode()
    def step(self) -> bool:
        """Admit waiting requests into free slots, then decode one token for every live slot."""
        with self._lock:
            if self._abort.is_set():
                with self._abort_lock:
                    targets = self._abort_ids
                    self._abort.clear()
                self._abort_requests(targets)
                return True
            try:
                if not self._paused.is_set():
                    self._admit()
                if not self._rows:
                    return False
                self._decode()
            except Exception as err:
                self._fail_live(err)
                raise
            return True

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        with self._lock:
            self.model.load_state_dict(state_dict, strict=False)
            self._layer_weights = None
            self.weight_version = version

    def pause(self) -> None:
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    def abort(self, request_ids: Collection[str] | None = None) -> None:
        with self._abort_lock:  # targets add up until the next step takes them
            if request_ids is None or self._abort_ids is None and self._abort.is_set():
                self._abort_ids = None
            else:
                self._abort_ids = (self._abort_ids if self._abort.is_set() else set()) | set(request_ids)
            self._abort.set()

    def flush_cache(self) -> None:
        with self._lock:
            if not self._rows:
                self._cache = None

    def release_memory(self) -> None:
        """Free the KV cache and the decode buffers sized by it (weights stay); the next admission re-creates
        them. Only while idle: live samples keep their cache."""
        with self._lock:
            if self._rows:
                return
            self._cache, self._rotary, self._shared = None, None, None
            self._positions = torch.arange(0, device=self.device)
            self._scratch_buffers = {}
            self._slots = _SlotState(self.device)
            if self.device.type == "cuda":  # hand the blocks back to the device (the trainer's process)
                torch.cuda.empty_cache()

    def cache_bytes(self) -> int:
        """Memory held by the slot KV cache (0 when none is allocated)."""
        cache = self._cache
        return 0 if cache is None else sum(t.numel() * t.element_size() for t in cache)

    def _fail_live(self, err: Exception) -> None:
        """A step failed: every admitted job (and the batch being admitted) answers with the error, so no
        caller waits forever, and the engine starts clean."""
        jobs = {id(row["job"]): row["job"] for row in self._rows} | {id(j): j for j in self._admitting}
        self._rows, self._admitting, self._live_configs, self._shared = [], [], {}, None
        for job in jobs.values():
            job.error = f"{type(err).__name__}: {err}"
            job.remaining = 0
            job.done.set()

    # ------------------------------------------------------------------ slot cache
    def _ensure_cache(self, slots: int, length: int) -> None:
        """Grow the preallocated K/V tensors to at least ``slots`` x ``length`` (copying live rows); within
        ``kv_cache_tokens`` (admission keeps ``slots x length`` inside it) the length may also shrink."""
        budget = self.kv_cache_tokens
        if self._cache is not None:
            k, _ = self._cache
            if k.shape[1] >= slots and k.shape[3] >= length:
                return
            if budget is None:
                slots, length = max(slots, k.shape[1]), max(length, k.shape[3])
        rounded = ((length + 63) // 64) * 64  # spare length and slots spare regrowing for the next requests
        if budget is None:
            slots, length = max(slots, 8), rounded
        else:  # only as far as they fit: slots x length <= budget
            length = max(length, min(rounded, budget // slots))
            spare = max(8, self._cache[0].shape[1]) if self._cache is not None else 8
            slots = max(slots, min(spare, budget // length))
        dtype = next(self.model.parameters()).dtype
        shape = (self.n_layers, slots, self.n_kv, length, self.head_dim)
        # zeros, not empty: unwritten positions are masked, and 0 * (stale NaN bits) would still be NaN
        new_k, new_v = (
            _zeros_in_huge_pages(shape, dtype, self.device),
            _zeros_in_huge_pages(shape, dtype, self.device),
        )
        if self._cache is not None and self._rows:
            old_k, old_v = self._cache
            r, t = len(self._rows), min(old_k.shape[3], length)  # live rows lie within the new length
            new_k[:, :r, :, :t] = old_k[:, :r]
            new_v[:, :r, :, :t] = old_v[:, :r]
        self._cache = (new_k, new_v)
        self._positions = torch.arange(length, device=self.device)
        # the native attention rotates in fp32 from fp32 tables, whatever the model's dtype
        self._rotary = self._rotary_tables(self._positions, dtype if self.kernels is None else torch.float32)

    def _rotary_tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own rotary cos/sin for every cache position, the sin's first half negated (see
        :func:`_rotate`)."""
        probe = torch.empty(0, dtype=dtype, device=self.device)
        cos, sin = self.model.model.rotary_emb(probe, positions.unsqueeze(0))
        half = self.head_dim // 2
        sign = torch.cat([-torch.ones(half, dtype=dtype), torch.ones(half, dtype=dtype)]).to(self.device)
        return cos[0], sin[0] * sign

    def _stop_ids(self, sampling: SamplingParams) -> list[int]:
        return ([] if sampling.ignore_eos else self.eos_token_ids) + list(sampling.stop_token_ids)

    def _admit(self) -> None:
        """Prefill as many waiting jobs as fit in free slots (and in ``kv_cache_tokens``: every slot as long
        as the longest row), in one batched forward."""
        if not self._queue:
            return
        free, budget, total = self.max_running - len(self._rows), self.kv_cache_tokens, len(self._rows)
        need_len = 0  # the longest row: prompt + max_new_tokens
        if self._rows:  # a live slot's prompt and budget
            live = len(self._rows)
            need_len = int((self._slots.prompt_lens(live) + self._slots.budget[:live]).max())
        batch: list[_Job] = []
        while self._queue:
            job = self._queue[0]
            job_len = max(need_len, len(job.request.input_ids) + job.sampling.max_new_tokens)
            fits = job.remaining <= free and (budget is None or (total + job.remaining) * job_len <= budget)
            if not (fits or not self._rows and not batch):
                break
            self._queue.popleft()
            free -= job.remaining
            total += job.remaining
            need_len = job_len
            batch.append(job)
        if not batch:
            return
        self._admitting = batch
        prompts = [j.request.input_ids for j in batch]
        lens = torch.tensor([len(p) for p in prompts], device=self.device)
        width = int(lens.max())
        self._ensure_cache(total, need_len)
        self._slots.ensure(
            total,
            max(j.sampling.max_new_tokens for j in batch),
            max(len(self._stop_ids(j.sampling)) for j in batch),
            len(self._rows),
        )
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
        for job in batch:
            stops, prompt_len = self._stop_ids(job.sampling), len(job.request.input_ids)
            first = len(self._rows)
            self._prompts_admitted += 1
            self._slots.start(
                slice(first, first + job.remaining),
                self._prompts_admitted,
                prompt_len,
                job.sampling.max_new_tokens,
                stops,
            )
            self._rows.extend({"job": job, "index": s} for s in range(job.remaining))
            self._live_configs.setdefault(id(job.sampling), [job.sampling, 0])[1] += job.remaining
        self._shared = None
        finished = self._sample_rows(logits[src], base, {id(j.sampling): j.sampling for j in batch})
        self._admitting = []
        self.peak_running = max(self.peak_running, len(self._rows))
        self._retire(finished)

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

    def _decode_weights(self) -> list[_LayerWeights]:
        if self._layer_weights is None:
            # the native attention takes its q/k norm weights in fp32, whatever the model's dtype
            norm_dtype = torch.float32 if self.kernels is not None else None
            self._layer_weights = [
                _layer_weights(layer, self.n_heads, self.n_kv, norm_dtype)
                for layer in self.model.model.layers
            ]
        return self._layer_weights

    def _decode(self) -> None:
        """Feed every live slot's pending token at its next position, sample the next one."""
        inner = self.model.model
        live = len(self._rows)
        lens = self._slots.lens[:live]
        h = inner.embed_tokens(self._slots.pending[:live])  # [R, hidden]
        if self.kernels is not None:
            h, norm = self._layers_native(h, lens), self.kernels.rms_norm
        else:
            h, norm = self._layers(h, lens), _rms
        logits = self.model.lm_head(norm(h, inner.norm.weight, self.model.config.rms_norm_eps))
        lens += 1
        self._retire(self._sample_rows(logits, 0, {k: c[0] for k, c in self._live_configs.items()}))

    def _layers(self, h: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """The decoder layers for one new token per slot, at positions ``lens``.

        Same math as the HF modules (RMSNorm accumulated in fp32, the model's own rotary table, softmax
        attention over the slot's cached keys) in about 17 ops a layer: fused projections, q/k norm and
        rotary on q and k together, residual adds fused into the output matmuls, in-place cache writes.
        """
        r = h.shape[0]
        n_h, n_kv, d = self.n_heads, self.n_kv, self.head_dim
        span = int(lens.max()) + 1
        k_cache, v_cache = self._cache  # type: ignore[misc]
        cos_table, sin_table = self._rotary  # type: ignore[misc]
        cos, sin = cos_table[lens].unsqueeze(1), sin_table[lens].unsqueeze(1)  # [R, 1, D]
        t_cap = k_cache.shape[3]
        slot_heads = torch.arange(r * n_kv, device=self.device).view(r, n_kv)
        flat_idx = (slot_heads * t_cap + lens.unsqueeze(1)).view(-1)
        # additive mask over the used cache length only: -inf past each slot's own position
        beyond = self._positions[:span].view(1, 1, 1, span) > lens.view(r, 1, 1, 1)
        mask = torch.zeros(beyond.shape, dtype=torch.float32, device=self.device).masked_fill_(
            beyond, -torch.inf
        )
        eps = self.model.config.rms_norm_eps
        for li, w in enumerate(self._decode_weights()):
            qkv = torch.nn.functional.linear(_rms(h, w.input_norm, eps), w.qkv)
            qk = _rotate(
                _rms(qkv[:, : (n_h + n_kv) * d].view(r, n_h + n_kv, d), None, eps) * w.qk_norm, cos, sin
            )
            k_cache[li].view(-1, d).index_copy_(0, flat_idx, qk[:, n_h:].reshape(r * n_kv, d))
            v_cache[li].view(-1, d).index_copy_(0, flat_idx, qkv[:, (n_h + n_kv) * d :].reshape(r * n_kv, d))
            keys, values = k_cache[li, :r, :, :span], v_cache[li, :r, :, :span]  # [R, Hkv, span, D] views
            scores = torch.matmul(qk[:, :n_h].view(r, n_kv, n_h // n_kv, d), keys.transpose(-1, -2))
            probs = torch.softmax(scores.float() + mask, dim=-1).to(values.dtype)
            h = torch.addmm(h, torch.matmul(probs, values).view(r, n_h * d), w.o_t)
            gate, up = torch.nn.functional.linear(_rms(h, w.post_norm, eps), w.gate_up).chunk(2, dim=-1)
            h = torch.addmm(h, torch.nn.functional.silu(gate) * up, w.down_t)
        return h

    def _layers_native(self, h: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """:meth:`_layers` with the fused kernels: 8 ops a layer, the 4 projection matmuls and 4 kernel calls
        (two norms, attention with its q/k norm, rotary and cache write, silu·up).

        The qkv and gate/up projections write into buffers reused every step, and the output projections add
        into the residual stream in place: memory freshly allocated each step tends to be out of the CPU cache
        after the attention's cache reads, the same buffers stay in it (about 3% of the tiny model's batch)."""
        kernels, eps = self.kernels, self.model.config.rms_norm_eps
        k_cache, v_cache = self._cache  # type: ignore[misc]
        cos_table, sin_table = self._rotary  # type: ignore[misc]
        r = h.shape[0]
        if self._shared is None:
            self._shared = self._slots.shared_prompts(r)
        share_slots, share_lens = self._shared
        for li, w in enumerate(self._decode_weights()):
            x = kernels.rms_norm(h, w.input_norm, eps)
            qkv = torch.mm(x, w.qkv.t(), out=self._scratch("qkv", r, w.qkv.shape[0]))
            attn = kernels.decode_attention(
                qkv,
                k_cache[li],
                v_cache[li],
                lens,
                share_slots,
                share_lens,
                cos_table,
                sin_table,
                w.qk_norm,
                eps,
                self.n_heads,
            )
            h.addmm_(attn, w.o_t)
            x = kernels.rms_norm(h, w.post_norm, eps)
            gate_up = torch.mm(x, w.gate_up.t(), out=self._scratch("gate_up", r, w.gate_up.shape[0]))
            h.addmm_(kernels.silu_mul(gate_up), w.down_t)
        return h

    def _scratch(self, name: str, rows: int, cols: int) -> torch.Tensor:
        """The first ``rows`` rows of a ``[≥ rows, cols]`` buffer kept across decode steps."""
        buffer = self._scratch_buffers.get(name)
        if buffer is None or buffer.shape[0] < rows or buffer.shape[1] != cols:
            dtype = next(self.model.parameters()).dtype
            buffer = self._scratch_buffers[name] = torch.empty(rows, cols, dtype=dtype, device=self.device)
        return buffer[:rows]

    def _sample_rows(self, logits: torch.Tensor, first: int, configs: dict[int, SamplingParams]) -> list[int]:
        """Sample the next token of live slots ``first, first + 1, ...`` from the rows of ``logits``, one
        batched draw per distinct sampling config of ``configs`` (id -> config, usually one); mark the samples
        that finished and return their slots."""
        rows = self._rows[first : first + logits.shape[0]]
        if len(configs) == 1:
            token, logp = sample_tokens(logits, next(iter(configs.values())), self.generator, self.kernels)
        else:
            token = torch.empty(len(rows), dtype=torch.long, device=self.device)
            logp = torch.empty(len(rows), device=self.device)
            for key, sampling in configs.items():
                picks = torch.tensor(
                    [j for j, row in enumerate(rows) if id(row["job"].sampling) == key], device=self.device
                )
                token[picks], logp[picks] = sample_tokens(
                    logits[picks], sampling, self.generator, self.kernels
                )
        stop_hit, full = self._slots.record(slice(first, first + len(rows)), token, logp)
        if self.tokenizer is not None and any(c.stop_strings for c in configs.values()):
            for j, row in enumerate(rows):
                stop_strings = row["job"].sampling.stop_strings
                if stop_strings and not stop_hit[j]:
                    tail = self.tokenizer.decode(self._slots.outputs([first + j])[0][0][-16:])
                    stop_hit[j] = any(s in tail for s in stop_strings)
        finished = (stop_hit | full).nonzero().flatten().tolist()
        for j in finished:
            rows[j]["finish"] = "stop" if stop_hit[j] else "length"
        return [first + j for j in finished]

    def _retire(self, finished: list[int]) -> None:
        """Move the ``finished`` rows (ascending slots) out; live rows past the new end fill the holes so live
        slots stay 0..R-1."""
        if not finished:
            return
        for i, output in zip(finished, self._slots.outputs(finished)):
            self._publish(self._rows[i], *output)
        live = len(self._rows) - len(finished)
        holes = [i for i in finished if i < live]
        movers = [i for i in range(live, len(self._rows)) if "finish" not in self._rows[i]]
        if holes:  # one gather/scatter per cache tensor; holes and movers are disjoint
            k_cache, v_cache = self._cache  # type: ignore[misc]
            dst, src = torch.tensor(holes, device=self.device), torch.tensor(movers, device=self.device)
            k_cache[:, dst] = k_cache[:, src]
            v_cache[:, dst] = v_cache[:, src]
            self._slots.move(dst, src)
            for hole, mover in zip(holes, movers):
                self._rows[hole] = self._rows[mover]
        del self._rows[live:]
        self._shared = None

    def _publish(self, row: dict[str, Any], output_ids: list[int], logprobs: list[float]) -> None:
        """Store a finished row's result in its job; the job is done once all its samples are."""
        job: _Job = row["job"]
        job.results[row["index"]] = GenerationResult(
            output_ids=output_ids,
            logprobs=logprobs,
            finish_reason=row["finish"],
            request_id=job.request.request_id,
            weight_version=self.weight_version,
        )
        job.remaining -= 1
        config = self._live_configs[id(job.sampling)]
        config[1] -= 1
        if config[1] == 0:
            del self._live_configs[id(job.sampling)]
        if job.remaining == 0:
            job.done.set()

    def _abort_requests(self, request_ids: set[str] | None) -> None:
        """Finish the targeted live rows with ``abort`` (tokens so far kept) and answer targeted queued jobs
        with empty aborts; ``None`` targets every request."""

        def targeted(job: _Job) -> bool:
            return request_ids is None or job.request.request_id in request_ids

        aborted = [i for i, row in enumerate(self._rows) if targeted(row["job"])]
        for i in aborted:
            self._rows[i].setdefault("finish", "abort")
        self._retire(aborted)
        for job in [j for j in self._queue if targeted(j)]:
            self._queue.remove(job)
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
        from relax_models.loader import KV_CACHE_KEY
        from relax_models.routing_replay import record_routing

        recording = record_routing(self.model) if self.record_routing else contextlib.nullcontext()
        with torch.no_grad(), recording as routed:
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
            cache, logits = getattr(out, KV_CACHE_KEY), out.logits[:, -1, :]
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
                    use_cache=True,
                    **{KV_CACHE_KEY: cache},
                )
                cache, logits = getattr(out, KV_CACHE_KEY), out.logits[:, -1, :]
                next_index = next_index + 1
            aborted = self._abort.is_set()
            routing = self._routing_rows(routed, prompts, width, n) if routed is not None else None
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
                        # the prompt and the response tokens fed back (all but the last sampled)
                        routing=routing[row][: len(prompts[row // n]) + max(length - 1, 0)]
                        if routing is not None
                        else None,
                    )
                )
            return results

    @staticmethod
    def _routing_rows(
        routed: list[torch.Tensor], prompts: list[list[int]], width: int, n: int
    ) -> list[torch.Tensor]:
        """Per sampled row, its recorded routing ``[prompt + decode steps, layers, top_k]`` on the CPU, from
        the left-padded prefill (``routed[0]``, ``[prompts * width, ...]``) and one ``[rows, ...]`` tensor per
        decode step (``routed[1:]``)."""
        prefill = routed[0].cpu().view(len(prompts), width, *routed[0].shape[1:])
        steps = torch.stack(routed[1:], 1).cpu() if len(routed) > 1 else None
        rows = []
        for row in range(len(prompts) * n):
            prompt = prefill[row // n, width - len(prompts[row // n]) :]
            # own storage per row: a view would pickle the whole prefill with each sample
            rows.append(prompt.clone() if steps is None else torch.cat([prompt, steps[row]]))
        return rows
