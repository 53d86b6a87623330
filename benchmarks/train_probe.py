"""Shared by the trainer-memory benchmarks (``fsdp_memory.py``, ``lora.py``): one synthetic GRPO batch, timed
optimizer steps on a backend, and what its tensors and process hold afterwards."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch


def peak_rss_mb() -> float:
    """This process's peak RSS (``VmHWM``). Not ``getrusage``: its ``ru_maxrss`` keeps the peak of the
    parent that forked a spawned process (which built the model folder), a floor under every measurement."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def tensor_mb(tensors) -> float:
    """Bytes of ``tensors`` in MiB (a DTensor counts its local shard)."""
    local = (t.to_local() if hasattr(t, "to_local") else t for t in tensors)
    return round(sum(t.numel() * t.element_size() for t in local) / 2**20, 1)


def synthetic_batch(tokenizer, samples: int, length: int):
    """``samples`` rows of random tokens, half prompt and half response, with advantages from -1 to 1."""
    from relax_core.samples import Sample, TrainBatch

    gen = torch.Generator().manual_seed(0)
    rows, half = [], length // 2
    for i in range(samples):
        ids = torch.randint(3, len(tokenizer), (length,), generator=gen).tolist()
        rows.append(
            Sample(i // 4, i % 4, ids[:half], ids[half:], [0.0] * half, [1] * half, reward=float(i % 2))
        )
    batch = TrainBatch.from_samples(rows, tokenizer.pad_token_id)
    batch.extras["advantages"] = torch.linspace(-1, 1, samples).unsqueeze(1) * batch.loss_mask
    return batch


def train_and_measure(backend, batch, steps: int, micro: int) -> dict[str, Any]:
    """Take ``steps`` GRPO-loss optimizer steps; the median step time and the trainer's tensor bytes."""
    from relax_core.algorithms.objective import micro_batch_weight, policy_objective, sequence_count
    from relax_core.config.schema import AlgorithmConfig

    algo = AlgorithmConfig()
    tokens, seqs = float(batch.loss_mask.sum()), sequence_count(batch, algo)

    def loss_fn(mb, logprobs, entropy):
        return policy_objective(mb, logprobs, entropy, algo, micro_batch_weight(mb, tokens, seqs, algo))

    times = []
    for _ in range(steps):
        start = time.perf_counter()
        backend.train_step(batch, loss_fn, micro)
        times.append(time.perf_counter() - start)
    params = list(backend.model.parameters())
    optim = [v for state in backend.optimizer.state.values() for v in state.values() if v.dim() > 0]
    return {
        "params_m": round(sum(p.numel() for p in params) / 1e6, 2),  # a DTensor counts its global size
        "trainable_m": round(sum(p.numel() for p in params if p.requires_grad) / 1e6, 3),
        "param_mb": tensor_mb(params),
        "grad_mb": tensor_mb(p.grad for p in params if p.grad is not None),
        "optim_mb": tensor_mb(optim),
        "peak_rss_mb": peak_rss_mb(),
        "step_s": round(statistics.median(times), 3) if times else None,
    }
