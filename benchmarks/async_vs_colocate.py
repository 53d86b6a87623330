"""Colocate vs fully asynchronous training on the default task, same seed and step budget.

    python benchmarks/async_vs_colocate.py                       # 200 RL steps per mode, staleness 1 and 2
    python benchmarks/async_vs_colocate.py --steps 30 --staleness 1 --bus-rows 256

Each mode runs ``python -m relax_launch`` (tiny Qwen3, digit sorting, 40-step warm-start, GRPO) in a
subprocess and is read back from its ``metrics.jsonl``. One JSON line per mode:

* ``steps_per_hour`` / ``samples_per_s``: RL steps (and generated samples) over the wall time of the RL
  phase (sum of ``step_time_s``; start-up, warm-start and the first evaluation excluded);
* ``final_reward``: mean train reward of the last 10 % of steps; ``eval_accuracy``: final greedy eval;
* ``actor_idle_frac``: 1 − Actor compute time / RL wall time (colocate: ``time/train_s`` (+ log-prob
  passes); async: ``time/actor_busy_s``, i.e. training minus the time it waited for data);
* ``mean_staleness``: average policy lag of the trained samples.

Then one JSON line per bus implementation: start-up seconds and put/get throughput (samples/s) for rows
shaped like a default step (prompt ~12 tokens, response ≤ 8 tokens, rewards, log-probs).

Budget: colocate gives each phase both cores (``num_threads=2``, ``--colocate-threads``); async gives the
Rollout and the Actor one core each (``num_threads=1``) because they run at the same time: with two threads
each on two cores, OpenMP threads spin on descheduled peers (at load 5-8 one 128-sample train step took
1.8-3.8 s with 2 threads against 0.26-0.30 s with 1). Async rollout is unchunked by default (``--chunk``):
the Actor's micro-batch is the whole step, so chunks only add engine calls. Numbers depend on machine load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ENV = os.environ | {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def run_mode(name: str, overrides: list[str], steps: int, seed: int, out_root: Path) -> dict:
    out = out_root / name
    cmd = [
        sys.executable,
        "-m",
        "relax_launch",
        f"trainer.total_steps={steps}",
        f"seed={seed}",
        "logger=jsonl",
        "logger.plot=false",
        f"trainer.eval_every={steps}",
        "trainer.sft_warmup_steps=40",  # the setup its README numbers were measured with
        f"hydra.run.dir={out}",
        *overrides,
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
    total_wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"mode": name, "error": proc.stdout[-2000:] + proc.stderr[-2000:]}
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rl = [r for r in rows if r["step"] > 0]
    wall = sum(r["step_time_s"] for r in rl)
    if any("time/actor_busy_s" in r for r in rl):
        busy = sum(r["time/actor_busy_s"] for r in rl)
    else:
        busy = sum(r.get("time/train_s", 0.0) + r.get("time/logprob_s", 0.0) for r in rl)
    samples = sum(1 for _ in rl) * batch_samples(overrides)
    tenth = max(1, len(rl) // 10)
    summary = json.loads((out / "summary.json").read_text())
    return {
        "mode": name,
        "steps": len(rl),
        "rl_wall_s": round(wall, 1),
        "total_wall_s": round(total_wall, 1),
        "steps_per_hour": round(3600 * len(rl) / wall, 1),
        "samples_per_s": round(samples / wall, 1),
        "final_reward": round(sum(r["reward/mean"] for r in rl[-tenth:]) / tenth, 4),
        "eval_accuracy": summary.get("eval_accuracy_final"),
        "actor_idle_frac": round(1 - busy / wall, 3),
        "mean_staleness": round(sum(r.get("staleness/mean", 0.0) for r in rl) / len(rl), 3),
        "mean_actor_data_wait_s": round(sum(r.get("time/actor_data_wait_s", 0.0) for r in rl) / len(rl), 3),
    }


def batch_samples(overrides: list[str]) -> int:
    vals = {k: v for k, _, v in (o.partition("=") for o in overrides)}
    return int(vals.get("rollout.batch_size", 16)) * int(vals.get("rollout.n_samples_per_prompt", 8))


def bus_throughput(rows: int, repeats: int) -> list[dict]:
    """put/get samples/s of each distributed bus, from the driver, rows shaped like a default step."""
    import ray
    import torch

    from relax_core.databus import start_databus
    from relax_core.databus.records import SAMPLE_FIELDS, sample_rows
    from relax_core.samples import Sample

    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(
            i // 8,
            i % 8,
            torch.randint(0, 13, (12,), generator=g).tolist(),
            torch.randint(0, 13, (1 + i % 8,), generator=g).tolist(),
            [-0.5] * (1 + i % 8),
            [1] * (1 + i % 8),
            reward=0.5,
        )
        for i in range(rows)
    ]
    results = []
    ray.init(address="local", num_cpus=6, include_dashboard=False, log_to_driver=False)
    try:
        for name in ("ray", "transferqueue"):
            t0 = time.perf_counter()
            bus = start_databus(name)
            init_s = time.perf_counter() - t0
            put_s = get_s = 0.0
            for rep in range(repeats):
                part = f"bench_{rep}"
                chunks = [samples[i : i + 32] for i in range(0, rows, 32)]  # 4-prompt groups of 8
                t = time.perf_counter()
                for c, chunk in enumerate(chunks):
                    keys, fields = sample_rows(chunk, c * 32)
                    bus.put(part, keys, fields)
                put_s += time.perf_counter() - t
                t = time.perf_counter()
                keys = bus.ready(part, SAMPLE_FIELDS)
                for i in range(0, len(keys), 64):  # micro-batches of 64
                    bus.get(part, keys[i : i + 64], SAMPLE_FIELDS)
                get_s += time.perf_counter() - t
                bus.clear(part)
            bus.close()
            results.append(
                {
                    "bus": name,
                    "init_s": round(init_s, 2),
                    "put_samples_per_s": round(rows * repeats / put_s, 1),
                    "get_samples_per_s": round(rows * repeats / get_s, 1),
                }
            )
    finally:
        ray.shutdown()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--staleness", default="1,2", help="comma-separated max_staleness values for async")
    ap.add_argument("--chunk", type=int, default=0, help="mode.rollout_chunk_prompts for async")
    ap.add_argument("--colocate-threads", type=int, default=2, help="torch threads of colocate's roles")
    ap.add_argument("--bus-rows", type=int, default=128)
    ap.add_argument("--bus-repeats", type=int, default=5)
    ap.add_argument("--skip-runs", action="store_true")
    ap.add_argument("--out", default=None, help="where runs write (default: a temp dir)")
    args = ap.parse_args()
    out_root = Path(args.out or tempfile.mkdtemp(prefix="relax_async_bench_"))
    cpus = ["cluster.num_cpus=4"]
    results = []
    if not args.skip_runs:
        threads = [
            f"rollout.num_threads={args.colocate_threads}",
            f"trainer.num_threads={args.colocate_threads}",
        ]
        colocate = run_mode("colocate", ["mode=colocate", *threads, *cpus], args.steps, args.seed, out_root)
        print(json.dumps(colocate), flush=True)
        results.append(colocate)
        for s in [int(x) for x in args.staleness.split(",") if x]:
            async_ = run_mode(
                f"async_s{s}",
                [
                    "mode=async",
                    f"mode.max_staleness={s}",
                    f"mode.rollout_chunk_prompts={args.chunk}",
                    "rollout.num_threads=1",
                    "trainer.num_threads=1",
                    *cpus,
                ],
                args.steps,
                args.seed,
                out_root,
            )
            if "steps_per_hour" in async_ and "steps_per_hour" in colocate:
                async_["speedup_vs_colocate"] = round(
                    async_["steps_per_hour"] / colocate["steps_per_hour"], 2
                )
            print(json.dumps(async_), flush=True)
    for line in bus_throughput(args.bus_rows, args.bus_repeats):
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
