"""Token-budget packed micro-batches vs padded ones, and chunked vs plain log-probs, on the CPU (or a GPU).

    python benchmarks/packing.py
    python benchmarks/packing.py --rows 64 --max-tokens 512 --repeats 3 --device cuda

One JSON line per measurement:

* ``train``: one optimizer step of the torch backend (tiny Qwen3: 4 layers, hidden 128) over the same rows,
  prompts of 10 tokens and responses of 8 to 256 tokens with a long tail (most short, a few long), as
  right-padded micro-batches of ``micro_batch_size`` rows or as ``trainer.max_tokens_per_micro_batch``
  packed micro-batches; ``tokens_per_s`` counts real (unpadded) tokens, median over ``--repeats`` steps
  after a warm-up step whose ``loss`` (same weights in every variant) shows they train the same objective.
* ``logprob_memory``: log-probs and entropy of 2048 response positions at a 32k vocabulary from bf16
  logits, forward and backward, each in a fresh process: ``peak_mb`` is the memory the step adds on top
  of the logits (peak RSS on the CPU, ``max_memory_allocated`` on a GPU), for the plain full-vocabulary
  path (``chunk_bytes`` above the step's size) and the chunked one (the default 16 MiB chunks).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

import torch

from relax_core.algorithms.logprobs import CHUNK_BYTES, response_logprobs_and_entropy
from relax_core.algorithms.objective import micro_batch_weight, policy_objective, sequence_count
from relax_core.backends.base import batch_to_device
from relax_core.backends.torch_backend import TorchBackend
from relax_core.config.schema import AlgorithmConfig, ModelConfig, TrainerConfig
from relax_core.samples import Sample, TrainBatch
from relax_models.tiny import build_tiny_qwen3

TINY = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)


def long_tail_batch(rows: int, vocab: int, seed: int = 0) -> TrainBatch:
    """``rows`` samples: 10-token prompts, responses 8·32^(u³) tokens (8 to 256, median ~12)."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(rows):
        u = float(torch.rand((), generator=gen))
        r = min(256, int(8 * 32 ** (u**3)))
        ids = torch.randint(3, vocab, (10 + r,), generator=gen).tolist()
        samples.append(Sample(i // 8, i % 8, ids[:10], ids[10:], [-1.0] * r, [1] * r, reward=float(i % 2)))
    batch = TrainBatch.from_samples(samples, pad_token_id=0)
    batch.extras["advantages"] = torch.linspace(-1.0, 1.0, rows).unsqueeze(1) * batch.loss_mask
    return batch


def train_rate(model_dir: str, trainer: TrainerConfig, batch: TrainBatch, repeats: int) -> dict:
    backend = TorchBackend(model_dir, trainer, ModelConfig())
    algo = AlgorithmConfig()
    total_tokens, total_seqs = float(batch.loss_mask.sum()), sequence_count(batch, algo)

    def loss_fn(mb, logprobs, entropy):
        return policy_objective(
            mb, logprobs, entropy, algo, micro_batch_weight(mb, total_tokens, total_seqs, algo)
        )

    # the first step (warm-up, untimed) starts from the same weights in every variant: its loss compares
    loss = backend.train_step(batch, loss_fn, trainer.micro_batch_size)["loss"]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        backend.train_step(batch, loss_fn, trainer.micro_batch_size)
        times.append(time.perf_counter() - t0)
    tokens = int(batch.attention_mask.sum())
    return {"tokens": tokens, "tokens_per_s": round(tokens / statistics.median(times), 1), "loss": loss}


def logprob_peak(chunk_bytes: int, device: str) -> dict:
    """The step in this process: peak memory it adds over the logits already held."""
    positions, vocab = 2048, 32768
    rows = 8
    samples = [Sample(i, 0, [1], [5] * (positions // rows), [0.0] * (positions // rows), [1] * (positions // rows))
               for i in range(rows)]  # fmt: skip
    batch = batch_to_device(TrainBatch.from_samples(samples, pad_token_id=0), torch.device(device))
    # drawn in bf16 directly: no fp32 temporary raises the high-water mark before the step
    logits = torch.empty(rows, positions // rows, vocab, device=device, dtype=torch.bfloat16)
    logits = logits.normal_().requires_grad_(True)
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _rss_mb() * 2**20
    logprobs, entropy = response_logprobs_and_entropy(logits, batch, 0.7, chunk_bytes=chunk_bytes)
    (logprobs.sum() + 0.01 * entropy.sum()).backward()
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"positions": positions, "vocab": vocab, "logits_mb": round(logits.numel() * 2 / 2**20, 1),
            "peak_mb": round(peak / 2**20, 1)}  # fmt: skip


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--logprob-step", type=int, default=None, help=argparse.SUPPRESS)  # child process
    args = parser.parse_args()
    if args.logprob_step is not None:
        print(json.dumps(logprob_peak(args.logprob_step, args.device)))
        return
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_qwen3(tmp, seed=0, **TINY))
        vocab = TorchBackend(
            model_dir, TrainerConfig(), ModelConfig(), trainable=False
        ).model.config.vocab_size
        batch = long_tail_batch(args.rows, vocab)
        base = TrainerConfig(lr=1e-4, lr_decay="constant", share_prompts=False)
        variants = [
            ("padded", replace(base, micro_batch_size=args.rows)),
            ("padded", replace(base, micro_batch_size=16)),
            ("packed", replace(base, micro_batch_size=args.rows, max_tokens_per_micro_batch=args.max_tokens)),
        ]
        for name, trainer in variants:
            rate = train_rate(model_dir, trainer, batch, args.repeats)
            knobs = {"micro_batch_size": trainer.micro_batch_size,
                     "max_tokens_per_micro_batch": trainer.max_tokens_per_micro_batch}  # fmt: skip
            print(
                json.dumps({"bench": "train", "variant": name, "rows": args.rows, **knobs, **rate}),
                flush=True,
            )
    for name, chunk in (("plain", 2**40), ("chunked", CHUNK_BYTES)):
        cmd = [sys.executable, __file__, "--logprob-step", str(chunk), "--device", args.device]
        child = subprocess.run(cmd, capture_output=True, text=True)
        if child.returncode:
            raise SystemExit(f"the {name} log-prob step failed:\n{child.stderr[-3000:]}")
        result = json.loads(child.stdout)
        print(
            json.dumps({"bench": "logprob_memory", "variant": name, "device": args.device, **result}),
            flush=True,
        )


if __name__ == "__main__":
    main()
