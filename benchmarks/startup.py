"""Start-up and exit cost of one launch: what every ``python -m relax_launch`` pays besides its steps.

    python benchmarks/startup.py --repeats 5
    python benchmarks/startup.py --repeats 5 --relax cluster=in_process

Each repeat runs a 2-step tiny experiment (2 warm-start steps, 4 prompts x 4 samples) in a subprocess, in a
fresh run dir, and reads the timestamps of its log lines. One JSON line per repeat, then the medians:

* ``driver_s``: from the command's start to Ray's session folder (imports, config, model folder and data,
  before ``ray.init``); ``ray_init_s``: to the "Ray up" line;
* ``roles_s``: to "roles up" (role processes start, import torch and transformers, load the model);
* ``run_s``: to the "done" line (warm-start, evaluations, the 2 steps, final export, plot, Ray's shutdown);
* ``exit_s``: from "done" to the process's exit; ``total_s``: the whole command.

The first repeat may build the tiny model into the user cache (``~/.cache/relax/tiny_models``); the medians
are of the repeats after it. Numbers depend on machine load: measure on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "resilience"))
from resilience_helpers import TINY_RUN  # noqa: E402  (the tests' tiny run)

ENV = os.environ | {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
# the cluster is the launch's own choice (cluster=in_process has no CPU count)
TINY = [o for o in TINY_RUN if not o.startswith("cluster.")] + ["trainer.total_steps=2"]
MARKS = {"ray_up": "Ray up:", "roles_up": "roles up", "done": "done: "}


def log_time(line: str) -> float:
    """Seconds since the epoch of a ``[YYYY-mm-dd HH:MM:SS,mmm][relax]...`` log line (local time)."""
    return datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def one_launch(run_dir: Path, ray_tmp: Path, extra: list[str]) -> dict:
    env = ENV | {"RAY_TMPDIR": str(ray_tmp)}
    start = time.time()
    done = subprocess.run(
        [sys.executable, "-m", "relax_launch", *TINY, *extra, f"hydra.run.dir={run_dir}"],
        env=env,
        capture_output=True,
        text=True,
    )
    end = time.time()
    if done.returncode != 0:
        raise SystemExit(f"launch failed:\n{done.stderr[-3000:]}")
    lines = (run_dir / "cli.log").read_text().splitlines()
    at = {k: next((log_time(ln) for ln in lines if mark in ln), None) for k, mark in MARKS.items()}
    sessions = sorted(ray_tmp.glob("ray/session_2*"))  # named after the moment ray.init started
    # session_<date>_<time>_<microseconds>_<pid>
    stamp = "_".join(sessions[-1].name.split("_")[1:4]) if sessions else None
    ray_start = datetime.strptime(stamp, "%Y-%m-%d_%H-%M-%S_%f").timestamp() if stamp else None
    row = {"total_s": end - start, "exit_s": end - at["done"]}
    if ray_start is not None:  # no Ray with cluster=in_process
        row |= {"driver_s": ray_start - start, "ray_init_s": at["ray_up"] - ray_start}
    row |= {"roles_s": at["roles_up"] - (at["ray_up"] or start), "run_s": at["done"] - at["roles_up"]}
    return {k: round(v, 2) for k, v in row.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--relax", nargs="*", default=[], help="extra overrides, e.g. cluster=in_process")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="relax-startup-") as tmp:
        for i in range(args.repeats):
            ray_tmp = Path(tmp) / f"ray{i}"
            ray_tmp.mkdir()
            row = {"repeat": i, **one_launch(Path(tmp) / f"run{i}", ray_tmp, args.relax)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    later = rows[1:] or rows
    keys = [k for k in later[0] if k != "repeat"]
    print(json.dumps({"median_of": len(later), **{k: statistics.median(r[k] for r in later) for k in keys}}))


if __name__ == "__main__":
    main()
