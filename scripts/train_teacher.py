"""Train the default on-policy-distillation teacher for the digits task and write it to a folder.

    python scripts/train_teacher.py --out teachers/digits            # ~2M-param tiny Qwen3, <1 min on CPU
    python -m relax_launch algorithm=opd algorithm.teacher.path=teachers/digits

Without ``--out`` it fills the cache folder that ``algorithm=opd`` with ``teacher.path=null`` uses.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

from relax_core.config.schema import DataConfig, TeacherConfig
from relax_core.roles.teacher import default_cache_dir, ensure_default_teacher


def main() -> None:
    defaults = TeacherConfig()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=None, help="output folder (default: the opd cache folder)")
    parser.add_argument("--hidden-size", type=int, default=defaults.hidden_size)
    parser.add_argument("--layers", type=int, default=defaults.num_hidden_layers)
    parser.add_argument("--steps", type=int, default=defaults.train_steps)
    parser.add_argument("--batch-size", type=int, default=defaults.train_batch_size)
    parser.add_argument("--lr", type=float, default=defaults.train_lr)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    teacher = TeacherConfig(
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        train_steps=args.steps,
        train_batch_size=args.batch_size,
        train_lr=args.lr,
    )
    start = time.perf_counter()
    folder = ensure_default_teacher(teacher, DataConfig(), seed=args.seed, folder=args.out)
    report = json.loads((folder / "relax_teacher.json").read_text())
    print(
        json.dumps(
            {
                "folder": str(folder),
                "greedy_accuracy": report["greedy_accuracy"],
                "final_nll": report["final_nll"],
                "seconds": round(time.perf_counter() - start, 1),
                "cache_root": str(default_cache_dir(teacher)),
            }
        )
    )


if __name__ == "__main__":
    main()
