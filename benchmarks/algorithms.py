"""Every algorithm of the suite on the default task for the same budget, several seeds.

    python benchmarks/algorithms.py                               # 11 algorithms x 3 seeds x 100 RL steps
    python benchmarks/algorithms.py --steps 20 --seeds 1 --algorithms grpo,ppo,opd --out /tmp/algo_bench

Each run is ``python -m relax_launch algorithm=<name> seed=<s> trainer.total_steps=<steps>`` in a
subprocess (tiny Qwen3, digit sorting, the default warm-start), read back from its ``metrics.jsonl``.
One JSON line per run:

* ``final_reward``: mean train reward over the last 10 % of RL steps (DAPO: over every generated sample,
  before dynamic sampling drops groups, so it is comparable);
* ``eval_accuracy``: exact-match greedy accuracy on the held-out prompts after the last step;
* ``wall_s``: wall time of the whole run (start-up, warm-start, RL, evaluation).

Then one summary line per algorithm (mean and std over seeds) and a comparison plot
(``<out>/algorithms.png``: mean reward curve per algorithm, and final eval accuracy per algorithm).
Numbers depend on machine load; the opd teacher is built once into ``<out>/cache`` (not timed per run).
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

ALGORITHMS = [
    "grpo", "dr_grpo", "dapo", "gspo", "sapo", "cispo", "rloo",
    "reinforce_pp", "reinforce_pp_baseline", "ppo", "opd",
]  # fmt: skip
ENV = os.environ | {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def run_one(name: str, seed: int, steps: int, out_root: Path, extra: list[str]) -> dict:
    """One run, or its stored result when ``<out>/<name>-s<seed>/result.json`` exists (a re-run of the
    script finishes an interrupted sweep instead of starting over)."""
    out = out_root / f"{name}-s{seed}"
    done = out / "result.json"
    if done.is_file():
        return json.loads(done.read_text())
    cmd = [
        sys.executable,
        "-m",
        "relax_launch",
        f"algorithm={name}",
        f"seed={seed}",
        f"trainer.total_steps={steps}",
        f"trainer.eval_every={steps}",
        "trainer.sft_warmup_steps=40",  # the setup its README numbers were measured with
        "logger=jsonl",
        "logger.plot=false",
        f"hydra.run.dir={out}",
        *([f"algorithm.teacher.cache_dir={out_root / 'cache'}"] if name == "opd" else []),
        *extra,
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"algorithm": name, "seed": seed, "error": (proc.stdout + proc.stderr)[-1500:]}
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rl = [r for r in rows if r["step"] > 0]
    key = "dynamic_sampling/reward_all_mean" if name == "dapo" else "reward/mean"
    curve = [r.get(key, r["reward/mean"]) for r in rl]
    tenth = max(1, len(curve) // 10)
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    result = {
        "algorithm": name,
        "seed": seed,
        "steps": len(rl),
        "final_reward": sum(curve[-tenth:]) / tenth,
        "first_reward": sum(curve[:tenth]) / tenth,
        "eval_accuracy": evals[-1] if evals else None,
        "wall_s": round(wall, 1),
        "rl_s": round(sum(r["step_time_s"] for r in rl), 1),
        "curve": curve,
    }
    done.write_text(json.dumps(result))
    return result


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "error" not in r]
    names = [n for n in ALGORITHMS if any(r["algorithm"] == n for r in ok)]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    colors = plt.get_cmap("tab20").colors  # 11 algorithms: the default 10-colour cycle would repeat one
    for index, name in enumerate(names):
        curves = [r["curve"] for r in ok if r["algorithm"] == name]
        length = min(len(c) for c in curves)
        mean = [statistics.fmean(c[i] for c in curves) for i in range(length)]
        left.plot(range(1, length + 1), mean, label=name, color=colors[index], lw=1.2)
    left.set(xlabel="RL step", ylabel="train reward (mean over seeds)", title="reward")
    left.legend(fontsize=7, ncol=2)
    accs = [[r["eval_accuracy"] or 0.0 for r in ok if r["algorithm"] == n] for n in names]
    right.bar(names, [statistics.fmean(a) for a in accs], yerr=[statistics.pstdev(a) for a in accs])
    right.set(ylabel="final eval accuracy", title="greedy exact match")
    right.tick_params(axis="x", rotation=60)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", default="outputs/bench_algorithms")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.algorithms.split(","):
        for seed in range(1, args.seeds + 1):
            result = run_one(name, seed, args.steps, out, args.overrides)
            results.append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "curve"}), flush=True)
    for name in args.algorithms.split(","):
        runs = [r for r in results if r["algorithm"] == name and "error" not in r]
        if runs:
            summary = {"algorithm": name, "seeds": len(runs), "steps": args.steps}
            for key in ("final_reward", "eval_accuracy", "wall_s"):
                values = [r[key] or 0.0 for r in runs]
                summary[f"{key}_mean"] = round(statistics.fmean(values), 4)
                summary[f"{key}_std"] = round(statistics.pstdev(values), 4)
            print(json.dumps(summary), flush=True)
    (out / "results.json").write_text(json.dumps(results))
    plot(results, out / "algorithms.png")
    print(json.dumps({"plot": str(out / "algorithms.png")}))


if __name__ == "__main__":
    main()
