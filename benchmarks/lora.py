"""Trainer memory and step time: LoRA adapters (``trainer.lora``) vs full fine-tuning, torch backend on CPU.

    python benchmarks/lora.py                        # tiny (0.8M) and 25M Qwen3 twins, rank 8, 3 steps
    python benchmarks/lora.py --sizes 340m --steps 1 # 340M (minutes per full fine-tuning step on 2 cores)

Each (size, kind) runs in a fresh spawned process (one thread) that builds the backend and takes ``--steps``
GRPO-loss steps on the same 16 x 64-token batch. One JSON line each:

* ``trainable_m``: trainable parameters (millions); ``grad_mb`` / ``optim_mb``: bytes of the gradient and
  AdamW-state tensors after the last step;
* ``peak_rss_mb``: the process's peak resident memory (``VmHWM``) after the steps, Python and torch included;
* ``step_s``: median wall time of one optimizer step.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp
from train_probe import synthetic_batch, train_and_measure

# random-init Qwen3 twins of the tiny builder: hidden x layers
SIZES = {"tiny": (128, 4), "25m": (512, 8), "340m": (1536, 12)}


def _run(_: int, size: str, rank: int, model_dir: str, args, out: str) -> None:
    torch.set_num_threads(1)
    from relax_core.backends.torch_backend import TorchBackend
    from relax_core.config.schema import LoRAConfig, ModelConfig, TrainerConfig
    from relax_models.loader import load_tokenizer

    trainer = TrainerConfig(lr=1e-4, lr_decay="constant", lora=LoRAConfig(rank=rank, alpha=2 * rank))
    backend = TorchBackend(model_dir, trainer, ModelConfig())
    batch = synthetic_batch(load_tokenizer(model_dir), args.samples, args.length)
    row = {"size": size, "kind": f"lora_r{rank}" if rank else "full"}
    row |= train_and_measure(backend, batch, args.steps, args.micro)
    row["batch"] = f"{args.samples}x{args.length}"
    (Path(out) / "row.json").write_text(json.dumps(row))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", default=["tiny", "25m"], choices=sorted(SIZES))
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    from relax_models.tiny import build_tiny_qwen3

    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            hidden, layers = SIZES[size]
            heads = max(4, hidden // 64)
            dims = dict(
                hidden_size=hidden,
                intermediate_size=3 * hidden,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=heads // 2,
                head_dim=hidden // heads,
                max_position_embeddings=256,
            )
            model_dir = str(build_tiny_qwen3(Path(tmp) / size, seed=0, **dims))
            for rank in (0, args.rank):
                mp.start_processes(
                    _run, args=(size, rank, model_dir, args, tmp), nprocs=1, start_method="spawn"
                )
                print(Path(tmp, "row.json").read_text(), flush=True)


if __name__ == "__main__":
    main()
