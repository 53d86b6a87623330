"""The torch engine under a KV-cache token budget (``rollout.kv_cache_tokens``) and with its cache released
between generations (``rollout.release_memory_during_train``), JSON lines.

Workload as ``rollout_throughput.py``: ``--prompts`` prompts x ``--samples`` samples x ``--new-tokens`` new
tokens at temperature 1, EOS ignored, on the random-init tiny and ~25M Qwen3 models, fp32. Per model:

- ``budget`` lines: tokens/s and the cache's bytes for no budget and for budgets of 1/2 and 1/4 of the
  tokens the whole batch needs (its rows wait in the queue instead);
- ``release`` lines: tokens/s when the cache is kept between generations and when it is released after
  each one (what colocate does every step), so the re-allocation's cost shows.

Each figure is the fastest of ``--repeats`` timed generations after a warm-up one.
Run: ``python benchmarks/kv_cache_budget.py [--sizes tiny,25m] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from rollout_throughput import SIZES, prompts_for, run_engine

from relax_core.engines.base import GenerationRequest, SamplingParams
from relax_core.engines.torch_engine import TorchEngine
from relax_models.loader import load_causal_lm, load_tokenizer
from relax_models.tiny import build_tiny_qwen3


def engine_for(path: str, tokenizer, kv_cache_tokens: int | None = None) -> TorchEngine:
    return TorchEngine(
        load_causal_lm(path),
        tokenizer.pad_token_id,
        [],
        seed=0,
        tokenizer=tokenizer,
        kv_cache_tokens=kv_cache_tokens,
    )


def run_released(engine: TorchEngine, prompts, n: int, new_tokens: int, repeats: int) -> tuple[float, int]:
    """:func:`run_engine` with the cache released before every timed generation (included in its time)."""
    requests = [GenerationRequest(p, str(i)) for i, p in enumerate(prompts)]
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, n=n)
    engine.generate(requests, SamplingParams(max_new_tokens=4, n=n))
    best = (float("inf"), 0)
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.release_memory()
        out = engine.generate(requests, sampling)
        best = min(best, (time.perf_counter() - t0, sum(len(r.output_ids) for r in out)))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="tiny,25m")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory(prefix="relax-bench-")
    for size in args.sizes.split(","):
        path = str(build_tiny_qwen3(Path(tmp.name) / size, seed=0, **SIZES[size]))
        tokenizer = load_tokenizer(path)
        prompts = prompts_for(tokenizer, args.prompts)
        whole = args.samples * sum(len(p) + args.new_tokens for p in prompts)
        common = {"model": size, "threads": args.threads, "batch_tokens": whole}
        for budget in (None, whole // 2, whole // 4):
            engine = engine_for(path, tokenizer, budget)
            seconds, tokens = run_engine(engine, prompts, args.samples, args.new_tokens, args.repeats)
            line = common | {"kv_cache_tokens": budget, "tokens_per_s": round(tokens / seconds, 1)}
            line |= {"cache_mib": round(engine.cache_bytes() / 2**20, 2)}
            print(json.dumps({"bench": "budget"} | line), flush=True)
        for released in (False, True):
            engine = engine_for(path, tokenizer)
            run = run_released if released else run_engine
            seconds, tokens = run(engine, prompts, args.samples, args.new_tokens, args.repeats)
            line = common | {"released_each_generation": released, "tokens_per_s": round(tokens / seconds, 1)}
            print(json.dumps({"bench": "release"} | line), flush=True)


if __name__ == "__main__":
    main()
