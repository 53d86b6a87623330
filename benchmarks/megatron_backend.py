"""Seconds per optimizer step and per log-prob pass: megatron backend (TP=1, TP=2) against the torch backend.

The default CPU model (tiny Qwen3, 0.8M parameters) and a GRPO-shaped batch (128 sequences of 16 prompt +
8 response tokens, one micro-batch). TP=2 runs in two gloo processes on 127.0.0.1, as the Actor replicas
of ``trainer.megatron.tensor=2`` do. Prints one JSON line per (backend, tensor) with medians over
``--steps`` timed steps after one warm-up step.

    python benchmarks/megatron_backend.py [--steps 10] [--threads 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.multiprocessing as mp

from relax_core.config.schema import ModelConfig, TinyModelSpec, TrainerConfig
from relax_core.samples import Sample, TrainBatch


def make_batch(n: int = 128, prompt: int = 16, response: int = 8, vocab: int = 13) -> TrainBatch:
    gen = torch.Generator().manual_seed(0)
    samples = [
        Sample(
            group_id=i // 8,
            index_in_group=i % 8,
            prompt_ids=torch.randint(3, vocab, (prompt,), generator=gen).tolist(),
            response_ids=torch.randint(3, vocab, (response,), generator=gen).tolist(),
            rollout_logprobs=[0.0] * response,
            loss_mask=[1] * response,
            reward=float(i % 3),
        )
        for i in range(n)
    ]
    batch = TrainBatch.from_samples(samples, pad_token_id=0)
    batch.extras["advantages"] = (batch.rewards - batch.rewards.mean()).unsqueeze(1) * batch.loss_mask
    return batch


def loss_fn(micro: TrainBatch, logprobs: torch.Tensor, entropy: torch.Tensor):
    mask = micro.loss_mask
    return (-micro.extras["advantages"] * logprobs * mask).sum() / mask.sum(), {}


def time_backend(backend, steps: int) -> dict[str, float]:
    batch = make_batch()
    backend.train_step(batch, loss_fn, 128)  # warm-up
    train, fwd = [], []
    for _ in range(steps):
        t = time.perf_counter()
        backend.train_step(batch, loss_fn, 128)
        train.append(time.perf_counter() - t)
        t = time.perf_counter()
        backend.forward_logprobs(batch, 128)
        fwd.append(time.perf_counter() - t)
    return {"train_step_s": statistics.median(train), "logprobs_s": statistics.median(fwd)}


def megatron_worker(rank: int, world: int, port: int, folder: str, steps: int, threads: int, queue) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(threads)
    from relax_core.backends.megatron_backend import MegatronBackend
    from relax_models.megatron.cpu_shim import init_process_group

    init_process_group(rank=rank, world_size=world, port=port)
    backend = MegatronBackend(folder, TrainerConfig(), ModelConfig(), seed=1, parallel={"tensor": world})
    result = time_backend(backend, steps)
    if rank == 0:
        queue.put(result)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    from relax_core.backends.torch_backend import TorchBackend
    from relax_models.ports import free_port
    from relax_models.tiny import build_tiny_qwen3

    with tempfile.TemporaryDirectory() as tmp:
        folder = str(build_tiny_qwen3(Path(tmp) / "tiny", seed=1, **dataclasses.asdict(TinyModelSpec())))
        torch.set_num_threads(args.threads)
        result = time_backend(TorchBackend(folder, TrainerConfig(), ModelConfig()), args.steps)
        print(json.dumps({"backend": "torch", "tensor": 1, "threads": args.threads, **result}))
        ctx = mp.get_context("spawn")
        for world in (1, 2):
            queue = ctx.Queue()
            port = free_port()
            mp.start_processes(
                megatron_worker,
                args=(world, port, folder, args.steps, args.threads, queue),
                nprocs=world,
                start_method="spawn",
            )
            print(
                json.dumps({"backend": "megatron", "tensor": world, "threads": args.threads, **queue.get()})
            )


if __name__ == "__main__":
    main()
