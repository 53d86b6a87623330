"""The memory doctor's prediction against the measured peak RSS of each role process, on CPU.

    python benchmarks/memory.py                          # tiny, cluster=in_process and Ray (cluster=local)
    python benchmarks/memory.py --sizes tiny,25m,340m --clusters in_process --steps 2

Each point launches ``python -m relax_launch`` with a few RL steps, samples the RSS of the launcher and every
process below it (Ray's workers included) every 0.1 s, and prints one JSON line per role process:
``predicted_mb`` (``relax_core.memory.estimate`` of the same overrides, no run needed), ``measured_mb``
(that process's peak RSS) and ``ratio`` (predicted / measured). ``data.max_prompt_len`` is set to the
task's longest prompt, so the doctor's worst case (every row at its length limits) is the run's.
The 25M and 340M sizes are random-init Qwen3 twins (hidden 512 x 8 layers, 1536 x 12 layers) of the tiny
builder; 340M on 2 cores takes minutes per step.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time

import psutil

SIZES = {
    "tiny": [],
    "25m": ["model.tiny.hidden_size=512", "model.tiny.intermediate_size=1536", "model.tiny.num_hidden_layers=8",
            "model.tiny.num_attention_heads=8", "model.tiny.num_key_value_heads=4", "model.tiny.head_dim=64"],
    "340m": ["model.tiny.hidden_size=1536", "model.tiny.intermediate_size=4608", "model.tiny.num_hidden_layers=12",
             "model.tiny.num_attention_heads=8", "model.tiny.num_key_value_heads=4", "model.tiny.head_dim=192"],
}  # fmt: skip
# "sort 31524:" is at most 11 characters (one token each) with the default 3-5 digits
RUN = ["data.max_prompt_len=11", "trainer.sft_warmup_steps=2", "trainer.eval_every=1000", "logger=jsonl"]


def _role(cmdline: list[str]) -> str | None:
    """The role a process runs: Ray titles an actor's worker ``ray::<Class>``; the launcher is relax_launch."""
    text = " ".join(cmdline)
    if text.startswith("ray::"):
        return text.split()[0].removeprefix("ray::").split(".")[0]
    if "relax_launch" in text:
        return "launcher"
    return None


def measure(overrides: list[str], out_dir: str) -> dict[str, int]:
    """Peak RSS (bytes) per role process of one run."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "relax_launch", *overrides, f"hydra.run.dir={out_dir}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    root, peaks, names = psutil.Process(proc.pid), {}, {}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            for p in procs:
                try:
                    role = _role(p.cmdline())
                    if role:
                        names[p.pid] = role
                        peaks[p.pid] = max(peaks.get(p.pid, 0), p.memory_info().rss)
                except psutil.Error:
                    pass
            time.sleep(0.1)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    _, err = proc.communicate()
    done.set()
    thread.join()
    if proc.returncode:
        raise SystemExit(f"run failed: {err[-2000:]}")
    return {f"{names[pid]} ({pid})": peak for pid, peak in peaks.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny")
    parser.add_argument("--clusters", default="in_process,local")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    from omegaconf import OmegaConf

    from relax_core.memory import estimate
    from relax_launch.cli import compose_config

    for size in args.sizes.split(","):
        for cluster in args.clusters.split(","):
            overrides = [f"cluster={cluster}", f"trainer.total_steps={args.steps}", *RUN, *SIZES[size]]
            report = estimate(OmegaConf.to_object(compose_config(overrides)))
            predicted = [(d.name, d.total) for d in report.devices]
            with tempfile.TemporaryDirectory() as out_dir:
                t0 = time.time()
                measured = measure(overrides, out_dir)
                wall = time.time() - t0
            for name, bytes_ in predicted:
                # the prediction's process: the launcher itself in_process, else the Ray actor of that role
                key = "launcher" if cluster == "in_process" else _ray_class(name)
                match = [v for k, v in measured.items() if k.startswith(key)]
                peak = max(match) if match else None
                print(
                    json.dumps(
                        {
                            "size": size,
                            "cluster": cluster,
                            "process": name,
                            "predicted_mb": round(bytes_ / 2**20),
                            "measured_mb": round(peak / 2**20) if peak else None,
                            "ratio": round(bytes_ / peak, 3) if peak else None,
                            "run_s": round(wall, 1),
                        }
                    ),
                    flush=True,
                )
            others = {k: round(v / 2**20) for k, v in measured.items()}
            print(json.dumps({"size": size, "cluster": cluster, "all_processes_mb": others}), flush=True)


def _ray_class(process: str) -> str:
    """The Ray actor class that hosts a predicted process (relax_core/roles)."""
    if "rollout engine" in process and "actor" in process:
        return "Colocated"
    if "rollout engine" in process:
        return "Rollout"
    return process.removeprefix("process ").split()[0].capitalize()


if __name__ == "__main__":
    main()
