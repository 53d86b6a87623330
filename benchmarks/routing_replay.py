"""R3, rollout routing replay: the train-vs-rollout log-prob mismatch and the step time with and without it.

    python benchmarks/routing_replay.py                      # fp32 and bf16, 20 RL steps each, seed 1
    python benchmarks/routing_replay.py --steps 10 --dtypes bfloat16 --out /tmp/r3

Each run is ``python -m relax_launch cluster=in_process model=tiny_qwen3_moe model.dtype=<dtype>
algorithm.routing_replay=<on|off>`` on the default task (no Ray: the timings are the roles' own), read back
from its ``metrics.jsonl``. One JSON line per run:

* ``train_rollout_abs_diff``: mean over RL steps of ``off_policy/train_rollout_abs_diff``, the mean
  |log π_train − log π_rollout| over the response tokens in the training forward (on-policy: all of it is
  numerics, part of it MoE routing flips, which replay removes);
* ``s_per_step``: median ``step_time_s`` after the first 2 RL steps (the summary takes the fastest of the
  ``--repeats`` interleaved runs: on a shared host load swings dwarf the difference);
* ``wall_s``: the whole run.

Then one line per dtype with the relative change of both. Numbers depend on machine load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ENV = os.environ | {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def run_one(dtype: str, replay: bool, steps: int, seed: int, out: Path, repeat: int) -> dict:
    run_dir = out / f"{dtype}-{'replay' if replay else 'plain'}-{repeat}"
    cmd = [
        sys.executable,
        "-m",
        "relax_launch",
        "cluster=in_process",
        "model=tiny_qwen3_moe",
        f"model.dtype={dtype}",
        f"algorithm.routing_replay={str(replay).lower()}",
        f"seed={seed}",
        f"trainer.total_steps={steps}",
        f"trainer.eval_every={steps}",
        "logger=jsonl",
        "logger.plot=false",
        f"hydra.run.dir={run_dir}",
    ]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rl = [r for r in rows if "off_policy/train_rollout_abs_diff" in r]
    return {
        "dtype": dtype,
        "routing_replay": replay,
        "steps": len(rl),
        "train_rollout_abs_diff": statistics.fmean(r["off_policy/train_rollout_abs_diff"] for r in rl),
        "s_per_step": statistics.median(r["step_time_s"] for r in rl[2:] or rl),
        "wall_s": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per setting (a busy host)")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_routing_replay"))
    args = parser.parse_args()
    for dtype in args.dtypes.split(","):
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for repeat in range(args.repeats):  # interleaved, so load changes hit both settings alike
            for replay in (False, True):
                runs[replay].append(run_one(dtype, replay, args.steps, args.seed, args.out, repeat))
                print(json.dumps(runs[replay][-1]), flush=True)
        # same seed: the abs diff is deterministic; the step time's least-disturbed run is its minimum
        plain, replay = (
            {k: min(r[k] for r in runs[x]) for k in ("train_rollout_abs_diff", "s_per_step")}
            for x in (False, True)
        )
        diff = replay["train_rollout_abs_diff"] / plain["train_rollout_abs_diff"] - 1
        overhead = replay["s_per_step"] / plain["s_per_step"] - 1
        print(
            json.dumps(
                {"dtype": dtype, "abs_diff_change": round(diff, 3), "step_overhead": round(overhead, 3)}
            )
        )


if __name__ == "__main__":
    main()
