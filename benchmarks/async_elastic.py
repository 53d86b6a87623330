"""Elastic rollout scaling in ``mode=async``: one run scaled out by one engine and back through the control
plane while it trains.

    python benchmarks/async_elastic.py                  # 60 steps: out after step 3, in after 8 steps on both
    python benchmarks/async_elastic.py --steps 80 --out-at 5 --scaled-steps 20 --set mode.max_staleness=2

Prints one JSON line per phase (``before``: one engine, ``scaled``: steps generated on both, ``after``: one
again) with its steps, mean ``step_time_s`` and ``tokens_per_s``, and one for the requests: seconds from
the scale-out POST to ACTIVE and to the first step generated on both engines, from the scale-in POST to
COMPLETED, and the run's sample balance (``samples/generated`` − ``samples/trained``; 0: nothing lost or
generated twice). Numbers depend on machine load: on a 2-core box a second engine splits the same cores.
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

import httpx


def _steps(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("step", 0) > 0 and "rollout/engines_used" in r]


def _wait(what: str, check, proc: subprocess.Popen, timeout: float = 900):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the run exited (code {proc.returncode}) while waiting for {what}")
        if value := check():
            return value
        time.sleep(0.2)
    raise SystemExit(f"timed out waiting for {what}")


def _request(http: httpx.Client, kind: str, body: dict, proc: subprocess.Popen) -> float:
    """Seconds from the POST until the request finished."""
    t = time.monotonic()
    reply = http.post(f"/rollout/{kind}", json=body)
    reply.raise_for_status()
    rid = reply.json()["request_id"]
    status = _wait(
        kind,
        lambda: (
            (s := http.get(f"/rollout/{kind}/{rid}").json()["status"]) in ("ACTIVE", "COMPLETED", "FAILED")
            and s
        ),
        proc,
    )
    if status == "FAILED":
        raise SystemExit(f"{kind} failed: {http.get(f'/rollout/{kind}/{rid}').json()}")
    return time.monotonic() - t


def _phase(name: str, rows: list[dict]) -> dict:
    n = max(len(rows), 1)
    return {
        "phase": name,
        "steps": len(rows),
        "step_time_s": sum(r["step_time_s"] for r in rows) / n,
        "tokens_per_s": sum(r["tokens_per_s"] for r in rows) / n,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out-at", type=int, default=4, help="scale out once this step is logged")
    parser.add_argument("--scaled-steps", type=int, default=8, help="scale in after this many steps on both")
    parser.add_argument("--set", action="append", default=[], help="extra key=value overrides")
    args = parser.parse_args()
    run = Path(tempfile.mkdtemp(prefix="relax-elastic-")) / "run"
    cmd = [sys.executable, "-m", "relax_launch", "mode=async", "logger=jsonl", "control_plane.enabled=true"]
    cmd += [f"trainer.total_steps={args.steps}", *args.set, f"hydra.run.dir={run}"]
    env = os.environ | {"RAY_USAGE_STATS_ENABLED": "0"}
    with open(run.parent / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        _wait(f"step {args.out_at}", lambda: len(_steps(run)) >= args.out_at, proc)
        url = json.loads((run / "control_plane.json").read_text())["url"]
        with httpx.Client(base_url=url, timeout=60) as http:
            t = time.monotonic()
            out_s = _request(http, "scale_out", {"num_replicas": 2}, proc)
            _wait(
                "a step on both engines",
                lambda: any(r["rollout/engines_used"] == 2 for r in _steps(run)),
                proc,
            )
            first_step_s = time.monotonic() - t
            _wait(
                f"{args.scaled_steps} steps on both engines",
                lambda: sum(r["rollout/engines_used"] == 2 for r in _steps(run)) >= args.scaled_steps,
                proc,
            )
            in_s = _request(http, "scale_in", {"num_replicas": 1}, proc)
        if proc.wait(timeout=1800) != 0:
            raise SystemExit(f"the run failed: see {run.parent / 'log.txt'}")
    finally:
        if proc.poll() is None:
            proc.terminate()
    rows = _steps(run)
    scaled = [r for r in rows if r["rollout/engines_used"] == 2]
    first, last = scaled[0]["step"], scaled[-1]["step"]
    for name, part in (
        ("before", [r for r in rows if r["step"] < first]),
        ("scaled", scaled),
        ("after", [r for r in rows if r["step"] > last]),
    ):
        print(json.dumps(_phase(name, part)))
    print(
        json.dumps(
            {
                "scale_out_to_active_s": round(out_s, 2),
                "scale_out_to_first_step_on_both_s": round(first_step_s, 2),
                "scale_in_to_completed_s": round(in_s, 2),
                "steps": len(rows),
                "samples_unbalanced": rows[-1]["samples/generated"] - rows[-1]["samples/trained"],
            }
        )
    )


if __name__ == "__main__":
    main()
