"""Colocate vs fully asynchronous training on the default task: same seeds, step budget and defaults.

    python benchmarks/async_vs_colocate.py --seeds 1,2,3 --plot docs/img/async_vs_colocate.png   # 500 steps
    python benchmarks/async_vs_colocate.py --steps 30 --seeds 1 --staleness 1 --skip-bus

Each (mode, seed) runs ``python -m relax_launch mode=<mode> seed=<seed>`` with every other setting at its
default (threads per role derived from the cores, off-policy correction on in async) in a subprocess and
is read back from its ``metrics.jsonl``. One JSON line per run, then one per mode over the seeds
(mean ± std):

* ``steps_per_hour``: RL steps over the wall time of the RL phase (sum of ``step_time_s``; start-up,
  warm-start and the first evaluation excluded); ``speedup``: async over colocate, seed by seed;
* ``final_reward``: mean train reward of the last 10 % of steps; ``eval_accuracy``: final greedy eval;
* ``overlap_bound``: the speed-up perfect overlap would give, from colocate's own phase times of the same
  seed: Σ step time / Σ max(rollout, train + weight sync + log-prob passes); ``of_bound``: speedup / bound;
* ``actor_idle_frac``: 1 − Actor compute time / RL wall time; ``mean_staleness``: policy lag of the
  trained samples.

Then one JSON line per bus implementation: start-up seconds and put/get throughput (samples/s) for rows
shaped like a default step (prompt ~12 tokens, response ≤ 8 tokens, rewards, log-probs).
Numbers depend on machine load: measure on a quiet machine.
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
    out = out_root / f"{name}_seed{seed}"
    cmd = [
        sys.executable,
        "-m",
        "relax_launch",
        f"trainer.total_steps={steps}",
        f"seed={seed}",
        "logger=jsonl",
        "logger.plot=false",
        f"hydra.run.dir={out}",
        *overrides,
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
    total_wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"mode": name, "seed": seed, "error": proc.stdout[-2000:] + proc.stderr[-2000:]}
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rl = [r for r in rows if r["step"] > 0]
    wall = sum(r["step_time_s"] for r in rl)
    if any("time/actor_busy_s" in r for r in rl):
        busy = sum(r["time/actor_busy_s"] for r in rl)
    else:
        busy = sum(r.get("time/train_s", 0.0) + r.get("time/logprob_s", 0.0) for r in rl)
    tenth = max(1, len(rl) // 10)
    summary = json.loads((out / "summary.json").read_text())
    result = {
        "mode": name,
        "seed": seed,
        "steps": len(rl),
        "rl_wall_s": round(wall, 1),
        "total_wall_s": round(total_wall, 1),
        "steps_per_hour": round(3600 * len(rl) / wall, 1),
        "final_reward": round(sum(r["reward/mean"] for r in rl[-tenth:]) / tenth, 4),
        "eval_accuracy": summary.get("eval_accuracy_final"),
        "actor_idle_frac": round(1 - busy / wall, 3),
        "mean_staleness": round(sum(r.get("staleness/mean", 0.0) for r in rl) / len(rl), 3),
        "rewards": [r["reward/mean"] for r in rl],
    }
    if name == "colocate":
        trainer_side = sum(
            r.get("time/train_s", 0.0) + r.get("time/weight_sync_s", 0.0) + r.get("time/logprob_s", 0.0)
            for r in rl
        )
        overlapped = sum(
            max(
                r.get("time/rollout_s", 0.0),
                r.get("time/train_s", 0.0) + r.get("time/weight_sync_s", 0.0) + r.get("time/logprob_s", 0.0),
            )
            for r in rl
        )
        result["overlap_bound"] = round(wall / overlapped, 3) if overlapped else None
        result["trainer_share"] = round(trainer_side / wall, 3)
    return result


def mean_std(values: list[float]) -> list[float]:
    n = len(values)
    mean = sum(values) / n
    std = (sum((v - mean) ** 2 for v in values) / max(n - 1, 1)) ** 0.5
    return [round(mean, 4), round(std, 4)]


def aggregate(runs: list[dict], colocate: dict[int, dict]) -> dict:
    """mean ± std over seeds of one mode's runs; speed-up and its share of the overlap bound per seed."""
    out = {"mode": runs[0]["mode"], "seeds": [r["seed"] for r in runs]}
    for key in ("steps_per_hour", "final_reward", "eval_accuracy", "actor_idle_frac", "mean_staleness"):
        out[key] = mean_std([float(r[key] or 0.0) for r in runs])
    if runs[0]["mode"] != "colocate":
        pairs = [(r, colocate[r["seed"]]) for r in runs if r["seed"] in colocate]
        speedups = [r["steps_per_hour"] / c["steps_per_hour"] for r, c in pairs]
        out["speedup"] = mean_std(speedups)
        out["overlap_bound"] = mean_std([c["overlap_bound"] for _, c in pairs])
        out["of_bound"] = mean_std(
            [sp / c["overlap_bound"] for sp, (_, c) in zip(speedups, pairs, strict=True)]
        )
    return out


def plot(by_mode: dict[str, list[dict]], path: str) -> None:
    """Train reward per step (mean over seeds, 10-step moving average) of every mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, runs in by_mode.items():
        steps = min(len(r["rewards"]) for r in runs)
        mean = [sum(r["rewards"][i] for r in runs) / len(runs) for i in range(steps)]
        smooth = [sum(mean[max(0, i - 9) : i + 1]) / len(mean[max(0, i - 9) : i + 1]) for i in range(steps)]
        ax.plot(range(1, steps + 1), smooth, label=f"{name} ({len(runs)} seeds)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("train reward (10-step mean)")
    ax.set_title("colocate vs async on the default task")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


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
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--seeds", default="1,2,3", help="comma-separated seeds")
    ap.add_argument("--staleness", default="1,2", help="comma-separated max_staleness values for async")
    ap.add_argument("--plot", default=None, help="write the reward curves to this PNG")
    ap.add_argument("--bus-rows", type=int, default=128)
    ap.add_argument("--bus-repeats", type=int, default=5)
    ap.add_argument("--skip-runs", action="store_true")
    ap.add_argument("--skip-bus", action="store_true")
    ap.add_argument("--out", default=None, help="where runs write (default: a temp dir)")
    args = ap.parse_args()
    out_root = Path(args.out or tempfile.mkdtemp(prefix="relax_async_bench_"))
    modes = {"colocate": ["mode=colocate"]}
    for s in [int(x) for x in args.staleness.split(",") if x]:
        modes[f"async_s{s}"] = ["mode=async", f"mode.max_staleness={s}"]
    by_mode: dict[str, list[dict]] = {name: [] for name in modes}
    if not args.skip_runs:
        for seed in [int(x) for x in args.seeds.split(",") if x]:
            for name, overrides in modes.items():
                result = run_mode(name, overrides, args.steps, seed, out_root)
                print(json.dumps({k: v for k, v in result.items() if k != "rewards"}), flush=True)
                if "error" not in result:
                    by_mode[name].append(result)
        colocate = {r["seed"]: r for r in by_mode["colocate"]}
        for runs in by_mode.values():
            if runs:
                print(json.dumps(aggregate(runs, colocate)), flush=True)
        if args.plot:
            plot({k: v for k, v in by_mode.items() if v}, args.plot)
    if not args.skip_bus:
        for line in bus_throughput(args.bus_rows, args.bus_repeats):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
