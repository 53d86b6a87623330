"""benchmarks/vs_trl.py counts the memory of a whole process tree (Ray workers included) and cleans it up."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("vs_trl", ROOT / "benchmarks" / "vs_trl.py")
vs_trl = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vs_trl)

# a parent holding 150 MB that starts a child holding 150 MB; the child outlives the parent (like a daemon)
TREE = """
import subprocess, sys, time
hold = b"x" * (150 * 2**20)
child = "import time; hold = b'x' * (150 * 2**20); print('ready', flush=True); time.sleep(60)"
proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE)
proc.stdout.readline()  # both buffers are resident now
time.sleep(1.5)  # a few samples of the monitor (it reads PSS every 0.5 s)
"""


def test_peak_counts_descendants_and_leftovers_are_killed(tmp_path: Path) -> None:
    code, wall, peak_mb, peak_pss_mb = vs_trl.run_measured([sys.executable, "-c", TREE], tmp_path / "log", {})
    assert code == 0 and wall > 0
    assert peak_mb > 300  # both 150 MB buffers: the child process is counted
    # the buffers are private pages, so PSS counts them whole too; shared library pages it counts in part
    assert 300 < peak_pss_mb < peak_mb
    leftovers = [
        p
        for p in psutil.process_iter(["cmdline"])
        if p.info["cmdline"] and "hold = b'x' * (150" in " ".join(p.info["cmdline"])
    ]
    assert leftovers == []  # the orphaned child was killed by run_measured


def test_summary_ratios_are_relax_over_trl() -> None:
    def run(tool: str, s: float, rss: float, reward: float) -> dict:
        return {
            "tool": tool,
            "seed": 0,
            "s_per_step": s,
            "train_s_per_step": s / 2,
            "total_wall_s": 10 * s,
            "peak_rss_mb": rss,
            "peak_pss_mb": rss / 2,
            "eval_reward": reward,
            "eval_accuracy": 0.0,
        }

    lines = vs_trl.summarize(
        [
            run("relax", 0.1, 900, 0.3),
            run("relax_in_process", 0.08, 540, 0.3),
            run("trl", 0.2, 600, 0.25),
            {"tool": "x", "error": "e"},
        ]
    )
    ratios = lines[-2]["relax_vs_trl"]
    assert ratios["s_per_step_ratio"] == 0.5 and ratios["peak_rss_mb_ratio"] == 1.5
    assert ratios["eval_reward_diff"] == 0.05
    in_process = lines[-1]["relax_in_process_vs_trl"]
    assert in_process["s_per_step_ratio"] == 0.4 and in_process["peak_rss_mb_ratio"] == 0.9
