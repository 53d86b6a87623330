"""Wall time of one step's rewards when some of them hang, per runner (in-process, process pool).

Each setting scores ``--samples`` samples of which ``--hung`` sleep far past ``reward.timeout_s``; the
others answer at once. Calls run concurrently, so the step should cost about one time-out however many
samples hang (plus a worker restart for the pool), not one per hung sample.

    python benchmarks/reward_timeouts.py   ->  one JSON line per setting
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from relax_rewards.executor import RewardExecutor, RewardItem  # noqa: E402

SLEEPY = f"{ROOT / 'tests' / 'rewards' / 'plugins_fixture.py'}:sleepy_reward"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--hung", type=int, default=16)
    p.add_argument("--timeout-s", type=float, default=1.0)
    p.add_argument("--workers", default="0,1,2", help="comma-separated reward.num_workers values")
    args = p.parse_args()
    batch = [RewardItem(f"s{i}", "7", "7", {"hang": i < args.hung}, group_id=i) for i in range(args.samples)]
    for workers in (int(w) for w in args.workers.split(",")):
        cfg = {"_target_": SLEEPY, "num_workers": workers, "timeout_s": args.timeout_s}
        with RewardExecutor.from_config(cfg) as ex:
            ex.score(batch[-1:])  # start the workers outside the measurement
            t0 = time.perf_counter()
            outs = ex.score(batch)
            wall = time.perf_counter() - t0
            stats = ex.stats()
        row = {
            "num_workers": workers,
            "samples": args.samples,
            "hung": args.hung,
            "timeout_s": args.timeout_s,
            "wall_s": round(wall, 2),
            "timeouts": sum(o.error == "timeout" for o in outs),
            "scored": sum(o.error is None for o in outs),
            "worker_restarts": stats["num_worker_restarts"],
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
