"""Per-rank memory and step time of the Actor backend: unsharded torch vs FSDP2 over 1 and 2 ranks.

    python benchmarks/fsdp_memory.py                      # 27M-parameter Qwen3, 16 x 64-token batch, 3 steps
    python benchmarks/fsdp_memory.py --hidden 256 --layers 4 --steps 2
    python benchmarks/fsdp_memory.py --hidden 1536 --layers 12 --steps 0   # 0.3B parameters: load only

Each configuration runs in fresh processes (gloo on 127.0.0.1, one thread per rank) and trains on the same
global batch. One JSON line per rank:

* ``param_mb`` / ``grad_mb`` / ``optim_mb``: bytes of this rank's parameter, gradient and AdamW-state
  tensors (local shards under FSDP), measured from the tensors after the last step;
* ``load_peak_rss_mb``: the process's peak resident memory once the backend is built (FSDP: every rank
  builds the model on the meta device and only rank 0 reads the weights, so the other ranks never hold
  the full model);
* ``peak_rss_mb``: the process's peak resident memory after the steps (includes Python and torch, so it
  falls by less than the tensor totals);
* ``step_s``: median wall time of one optimizer step (the global batch split over the ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp
from train_probe import peak_rss_mb, synthetic_batch, train_and_measure


def _rank(rank: int, world: int, kind: str, port: int, model_dir: str, args, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from relax_core.backends.fsdp_backend import FSDPBackend
    from relax_core.backends.torch_backend import TorchBackend
    from relax_core.config.schema import ModelConfig, TrainerConfig
    from relax_models.loader import load_tokenizer

    trainer = TrainerConfig(lr=1e-4, lr_decay="constant", fsdp=kind == "fsdp", dp_size=world)
    backend = (FSDPBackend if kind == "fsdp" else TorchBackend)(model_dir, trainer, ModelConfig())
    load_peak_rss_mb = peak_rss_mb()
    batch = synthetic_batch(load_tokenizer(model_dir), args.samples, args.length)
    measured = train_and_measure(backend, batch, args.steps, args.micro)
    row = {"kind": kind, "ranks": world, "rank": rank, "params_total_m": measured.pop("params_m")}
    row |= {k: measured[k] for k in ("param_mb", "grad_mb", "optim_mb")}
    row |= {"load_peak_rss_mb": load_peak_rss_mb, "peak_rss_mb": measured["peak_rss_mb"]}
    row |= {"step_s": measured["step_s"], "global_batch": f"{args.samples}x{args.length}"}
    (Path(out) / f"{kind}{world}_{rank}.json").write_text(json.dumps(row))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    from relax_models.megatron.cpu_shim import free_port
    from relax_models.tiny import build_tiny_qwen3

    with tempfile.TemporaryDirectory() as tmp:
        dims = dict(
            hidden_size=args.hidden,
            intermediate_size=3 * args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=args.hidden // 8,
            max_position_embeddings=256,
        )
        model_dir = str(build_tiny_qwen3(Path(tmp) / "model", seed=0, **dims))
        for kind, world in (("torch", 1), ("fsdp", 1), ("fsdp", 2)):
            mp.start_processes(
                _rank,
                args=(world, kind, free_port(), model_dir, args, tmp),
                nprocs=world,
                start_method="spawn",
            )
            for rank in range(world):
                print(Path(tmp, f"{kind}{world}_{rank}.json").read_text(), flush=True)


if __name__ == "__main__":
    main()
