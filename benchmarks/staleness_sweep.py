"""One staleness knob, measured: colocate and ``mode=async`` at ``mode.max_staleness`` 0, 1, 2, 4 on the same
seeds and step budget, on the default task and on a multimodal one.

    python benchmarks/staleness_sweep.py                                   # default (500 steps) + vision (40)
    python benchmarks/staleness_sweep.py --tasks default --steps 200 --seeds 1,2,3
    python benchmarks/staleness_sweep.py --tasks vision --staleness 0,1 --plot /tmp/sweep.png
    python benchmarks/staleness_sweep.py --steps 3 --set trainer.sft_warmup_steps=2 --plot /tmp/smoke.png

``--tasks``: ``default`` (digit sorting) and ``vision`` (``experiment=vision_colors_tiny_vl``: the tiny
Qwen3-VL twin reading a square's colour). ``--steps`` is one count for every task or ``task=N,...``
(default: each task's own). Every setting runs ``python -m relax_launch`` in a subprocess with everything
else at its default (async: chunked rollout, off-policy correction above staleness 0), through
``benchmarks/async_vs_colocate.py``'s ``run_mode``, and is read back from its ``metrics.jsonl``.

One JSON line per run (task, mode, staleness, seed, ``s_per_step`` and ``steps_per_hour`` over the RL phase,
``final_reward`` over the last 10 % of steps, ``eval_accuracy`` of the final greedy eval,
``mean_staleness`` as logged; async runs also ``max_abs_reward_diff_vs_colocate``: the largest per-step
difference from colocate's train reward on the same seed), then one per (task, setting) over the seeds
(mean ± std, ``speedup`` over colocate seed by seed). The plot has one row per task: train reward per step
of every setting, and throughput against staleness (colocate as a band). A run that fails (on a crowded
machine Ray's memory monitor may kill a role) runs again up to ``--retries`` times, each failure printing its
line. Numbers depend on machine load: measure on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from async_vs_colocate import WORKLOADS, aggregate, mean_std, plot_rewards, run_mode

# task -> (launcher overrides, RL steps)
TASKS = {name: WORKLOADS[name] for name in ("default", "vision")}


def settings(staleness: list[int]) -> dict[str, tuple[str, int | None, list[str]]]:
    """setting name -> (mode, max_staleness, overrides)."""
    out: dict[str, tuple[str, int | None, list[str]]] = {"colocate": ("colocate", None, ["mode=colocate"])}
    for s in staleness:
        out[f"async_s{s}"] = ("async", s, ["mode=async", f"mode.max_staleness={s}"])
    return out


def steps_per_task(arg: str | None, tasks: list[str]) -> dict[str, int]:
    if arg is None:
        return {t: TASKS[t][1] for t in tasks}
    if "=" not in arg:
        return dict.fromkeys(tasks, int(arg))
    given = {k: int(v) for k, _, v in (part.partition("=") for part in arg.split(","))}
    return {t: given.get(t, TASKS[t][1]) for t in tasks}


def plot(results: dict[str, dict[str, list[dict]]], path: str) -> None:
    """Per task: reward curves of every setting, and steps/h (mean ± std over seeds) against staleness."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(12, 4 * len(results)), squeeze=False)
    for (task, by_setting), (rewards_ax, speed_ax) in zip(results.items(), axes, strict=True):
        plot_rewards(rewards_ax, {k: v for k, v in by_setting.items() if v})
        rewards_ax.set_title(f"{task}: train reward per step")
        rewards_ax.legend(fontsize=8)
        async_runs = {
            runs[0]["staleness"]: runs for name, runs in by_setting.items() if runs and name != "colocate"
        }
        xs = sorted(async_runs)
        stats = [mean_std([r["steps_per_hour"] for r in async_runs[s]]) for s in xs]
        speed_ax.errorbar(
            xs, [m for m, _ in stats], yerr=[sd for _, sd in stats], marker="o", capsize=3, label="async"
        )
        if by_setting.get("colocate"):
            mean, std = mean_std([r["steps_per_hour"] for r in by_setting["colocate"]])
            speed_ax.axhline(mean, color="k", linestyle="--", label="colocate")
            speed_ax.axhspan(mean - std, mean + std, color="k", alpha=0.1)
        speed_ax.set_xticks(xs)
        speed_ax.set_xlabel("mode.max_staleness")
        speed_ax.set_ylabel("RL steps per hour")
        speed_ax.set_title(f"{task}: throughput vs staleness")
        speed_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="default,vision", help=f"comma-separated, of {sorted(TASKS)}")
    ap.add_argument(
        "--steps", default=None, help="RL steps: N for every task, or task=N,... (default: each task's)"
    )
    ap.add_argument("--seeds", default="1", help="comma-separated seeds")
    ap.add_argument("--staleness", default="0,1,2,4", help="comma-separated mode.max_staleness values")
    ap.add_argument("--plot", default="docs/img/staleness_sweep.png", help="PNG to write ('' for none)")
    ap.add_argument(
        "--retries", type=int, default=1, help="runs again a run that failed (e.g. killed for memory)"
    )
    ap.add_argument("--set", action="append", default=[], help="extra override key=value for every run")
    ap.add_argument("--out", default=None, help="where runs write (default: a temp dir)")
    args = ap.parse_args()
    tasks = [t for t in args.tasks.split(",") if t]
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown:
        ap.error(f"--tasks {','.join(unknown)}: unknown task; choose from {','.join(sorted(TASKS))}")
    steps = steps_per_task(args.steps, tasks)
    seeds = [int(x) for x in args.seeds.split(",") if x]
    grid = settings([int(x) for x in args.staleness.split(",") if x])
    out_root = Path(args.out or tempfile.mkdtemp(prefix="relax_staleness_sweep_"))
    results: dict[str, dict[str, list[dict]]] = {}
    for task in tasks:
        base = [*TASKS[task][0], *args.set]
        by_setting: dict[str, list[dict]] = {name: [] for name in grid}
        for seed in seeds:  # every setting of a seed back to back, so load drift spreads over all of them
            for name, (mode, staleness, overrides) in grid.items():
                for attempt in range(1 + args.retries):
                    out = out_root / task / (f"retry{attempt}" if attempt else "")  # a fresh run dir
                    result = run_mode(name, [*base, *overrides], steps[task], seed, out)
                    result |= {"task": task, "mode": mode, "staleness": staleness, "attempt": attempt}
                    if "error" not in result:
                        break
                    print(json.dumps(result), flush=True)
                if "error" not in result:
                    result["s_per_step"] = round(result["rl_wall_s"] / result["steps"], 4)
                    colocate = next((r for r in by_setting["colocate"] if r["seed"] == seed), None)
                    if mode == "async" and colocate is not None:
                        pairs = zip(result["rewards"], colocate["rewards"], strict=False)
                        result["max_abs_reward_diff_vs_colocate"] = round(
                            max(abs(a - b) for a, b in pairs), 6
                        )
                    by_setting[name].append(result)
                    print(json.dumps({k: v for k, v in result.items() if k != "rewards"}), flush=True)
        colocate_by_seed = {r["seed"]: r for r in by_setting["colocate"]}
        for name, runs in by_setting.items():
            if runs:
                line = {
                    "task": task,
                    "setting": name,
                    "staleness": runs[0]["staleness"],
                    "steps": steps[task],
                }
                line |= aggregate(runs, colocate_by_seed)
                line["s_per_step"] = mean_std([r["s_per_step"] for r in runs])
                print(json.dumps(line), flush=True)
        results[task] = by_setting
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
