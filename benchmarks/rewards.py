"""Throughput of the reward executor on 1,000 math samples, in-process and with a 2-process pool, and the
cost of ``reward=code``'s sandbox on 96 code samples (``--code``: only that part).

Samples mimic GRPO rollouts: 125 prompts x 8 responses, each a short chain of thought ending in a
boxed answer written in one of several equivalent forms (fraction, decimal, \\dfrac, percentage,
units, interval, set) or a wrong one. Worker start-up and the LaTeX parser's cold caches are excluded
(a 200-sample warm-up batch first), as in a long training run.

    python benchmarks/rewards.py   ->  one JSON line per num_workers setting, then one for reward=code

``samples_per_s`` is wall-clock throughput (it depends on how busy the machine is);
``cpu_ms_per_sample`` is the CPU time this process and its workers spent per sample (for ``code``: with the
sandboxes' processes, all children of this one).
The code samples are ``data=code_tiny``-like rows (half three stdin/stdout tests, half three asserts), each
answered by a correct program or a wrong one, scored in-process 8 at a time (``reward.concurrency``).
"""

from __future__ import annotations

import json
import random
import resource
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relax_rewards.executor import RewardExecutor, RewardItem  # noqa: E402

NUM_PROMPTS, SAMPLES_PER_PROMPT = 125, 8


def _problem(rng: random.Random) -> tuple[str, list[str], list[str]]:
    """(gold, correct answer spellings, wrong answer spellings) for one random problem."""
    kind = rng.choice(["fraction", "integer", "percent", "interval", "set", "units", "sqrt"])
    a, b = rng.randint(1, 40), rng.randint(41, 97)
    if kind == "fraction":
        gold = rf"\frac{{{a}}}{{{b}}}"
        return (
            gold,
            [gold, rf"\dfrac{{{a}}}{{{b}}}", f"{a}/{b}"],
            [rf"\frac{{{b}}}{{{a}}}", rf"\frac{{{a + 1}}}{{{b}}}"],
        )
    if kind == "integer":
        n = a * b
        return str(n), [str(n), f"{n:,}", f"x = {n}"], [str(n + 1), str(n - b)]
    if kind == "percent":
        return rf"{a}\%", [rf"{a}\%", str(a), f"{a / 100:g}"], [rf"{a + 5}\%", str(a + 10)]
    if kind == "interval":
        gold = f"[{a}, {b})"
        return gold, [gold, rf"\left[{a},{b}\right)"], [f"({a}, {b}]", f"[{a}, {b + 1})"]
    if kind == "set":
        gold = rf"\{{{a}, {b}\}}"
        return gold, [rf"\{{{b},{a}\}}", gold], [rf"\{{{a}, {b}, {a + b}\}}", rf"\{{{a}\}}"]
    if kind == "units":
        return str(b), [rf"{b}\text{{ cm}}", f"{b} meters"], [rf"{b + 2}\text{{ cm}}", f"{a} meters"]
    gold = rf"{a}\sqrt{{2}}"
    return gold, [gold, rf"\sqrt{{{2 * a * a}}}"], [rf"{a}\sqrt{{3}}", rf"{a + 1}\sqrt{{2}}"]


def _response(rng: random.Random, answer: str) -> str:
    steps = " ".join(
        f"Step {i + 1}: we have {rng.randint(2, 99)} and {rng.randint(2, 99)}, so combining them gives "
        f"{rng.randint(100, 999)}."
        for i in range(rng.randint(3, 8))
    )
    if rng.random() < 0.3:  # a reasoning model that boxes an intermediate value before the final one
        steps += rf" A first guess is \boxed{{{rng.randint(1, 9)}}}, but checking again:"
    return f"<think>{steps}</think>\nTherefore the final answer is $\\boxed{{{answer}}}$."


def make_items(seed: int = 0) -> list[RewardItem]:
    rng = random.Random(seed)
    out = []
    for p in range(NUM_PROMPTS):
        gold, right, wrong = _problem(rng)
        for s in range(SAMPLES_PER_PROMPT):
            answer = rng.choice(right) if rng.random() < 0.5 else rng.choice(wrong)
            out.append(RewardItem(f"p{p}s{s}", _response(rng, answer), gold, None, group_id=p))
    return out


def _cpu_s(procs: list[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def make_code_items(n: int = 96, seed: int = 0) -> list[RewardItem]:
    """``n`` code samples: stdin rows answered by ``print(int(input()) + k)``, assert rows by ``def f(n)``."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k, bias = rng.randint(1, 99), rng.choice([0, 0, 1])  # a third of the programs are wrong
        ns = [rng.randint(0, 999) for _ in range(3)]
        if i % 2:
            label = {"tests": [{"stdin": f"{v}\n", "stdout": str(v + k)} for v in ns]}
            program = f"print(int(input()) + {k + bias})\n"
        else:
            label = {"asserts": [f"assert f({v}) == {v + k}" for v in ns]}
            program = f"def f(n):\n    return n + {k + bias}\n"
        out.append(RewardItem(f"c{i}", f"```python\n{program}```", label, group_id=i // 8))
    return out


def _self_and_children_cpu_s() -> float:
    return sum(
        u.ru_utime + u.ru_stime
        for u in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
    )


def bench_code() -> None:
    items = make_code_items()
    cfg = {"name": "code", "num_workers": 0, "concurrency": 8, "timeout_s": 60.0}
    with RewardExecutor.from_config(cfg) as ex:
        ex.score(make_code_items(8, seed=1))  # warm-up
        cpu0, t0 = _self_and_children_cpu_s(), time.perf_counter()
        outs = ex.score(items)
        wall, cpu = time.perf_counter() - t0, _self_and_children_cpu_s() - cpu0
    line = {
        "bench": "rewards",
        "reward": "code",
        "concurrency": 8,
        "samples": len(items),
        "tests_per_sample": 3,
        "samples_per_s": round(len(items) / wall, 1),
        "cpu_ms_per_sample": round(1000 * cpu / len(items), 1),
        "mean_reward": round(sum(o.reward for o in outs) / len(outs), 3),
        "errors": sum(o.error is not None for o in outs),
    }
    print(json.dumps(line), flush=True)


def main() -> None:
    if "--code" in sys.argv[1:]:
        bench_code()
        return
    items = make_items()
    for num_workers in (0, 2):
        cfg = {"name": "math", "num_workers": num_workers, "timeout_s": 10.0}
        with RewardExecutor.from_config(cfg) as ex:
            ex.score(make_items(seed=1)[:200])  # warm-up: worker start-up, imports, parser caches
            # this process and its reward workers: CPU time per sample does not depend on machine load
            procs = [psutil.Process(), *psutil.Process().children()]
            cpu0, t0 = _cpu_s(procs), time.perf_counter()
            outs = ex.score(items)
            wall, cpu = time.perf_counter() - t0, _cpu_s(procs) - cpu0
        line = {
            "bench": "rewards",
            "reward": "math",
            "num_workers": num_workers,
            "samples": len(items),
            "samples_per_s": round(len(items) / wall, 1),
            "cpu_ms_per_sample": round(1000 * cpu / len(items), 2),
            "mean_reward": round(sum(o.reward for o in outs) / len(outs), 3),
            "errors": sum(o.error is not None for o in outs),
        }
        print(json.dumps(line), flush=True)
    bench_code()


if __name__ == "__main__":
    main()
