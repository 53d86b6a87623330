"""Where the test suite's time goes: wall time and host CPU use per test file.

Runs pytest in this process with a recorder plugin and prints JSON lines, the slowest files first, then a
total per tier (``quick``: what ``tests/run.sh --quick`` runs; ``heavy``: the rest, tests/tiers.py), then the
total. ``cpu_busy_share`` is the host's busy CPU time (every process: Ray workers, launched runs) over
wall time times the host's cores, read from /proc/stat around each test; a file far below 1 leaves cores
idle (waiting on timeouts, process start, one-thread runs) and is the place to run work side by side.

    python benchmarks/suite_profile.py                    # the whole suite (as tests/run.sh, no Slurm set-up)
    python benchmarks/suite_profile.py --quick            # the quick tier
    python benchmarks/suite_profile.py tests/core -x      # any other pytest arguments
    python benchmarks/suite_profile.py --summarize tests.jsonl   # a recorded run again

Linux only. Run it alone: other load on the host counts as busy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path


def host_cpu_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of every core since boot."""
    with open("/proc/stat") as stat:
        ticks = [int(x) for x in stat.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle + iowait
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - idle) / hz, sum(ticks) / hz


class Recorder:
    """pytest plugin: one record per test (setup, call and teardown together)."""

    def __init__(self, out: Path) -> None:
        self.out = out.open("w", buffering=1)
        self.started = (0.0, (0.0, 0.0))
        self.tiers: dict[str, str] = {}

    def pytest_collection_finish(self, session) -> None:
        # the items as tests/conftest.py left them: its heavy ones marked
        self.tiers = {
            item.nodeid: "heavy" if item.get_closest_marker("heavy") else "quick" for item in session.items
        }

    def pytest_runtest_logstart(self, nodeid: str, location: tuple) -> None:
        self.started = (time.monotonic(), host_cpu_seconds())

    def pytest_runtest_logfinish(self, nodeid: str, location: tuple) -> None:
        busy, total = host_cpu_seconds()
        wall = time.monotonic() - self.started[0]
        record = {
            "test": nodeid,
            "wall_s": wall,
            "busy_cpu_s": busy - self.started[1][0],
            "host_cpu_s": total - self.started[1][1],
            "tier": self.tiers[nodeid],
        }
        self.out.write(json.dumps(record) + "\n")


def summarize(records: list[dict]) -> list[dict]:
    files: dict[str, dict] = defaultdict(
        lambda: {"tests": 0, "wall_s": 0.0, "busy_cpu_s": 0.0, "host_cpu_s": 0.0}
    )
    for record in records:
        row = files[record["test"].split("::")[0]]
        row["tests"] += 1
        for key in ("wall_s", "busy_cpu_s", "host_cpu_s"):
            row[key] += record[key]
    lines = []
    for name, row in sorted(files.items(), key=lambda item: -item[1]["wall_s"]):
        share = row["busy_cpu_s"] / row["host_cpu_s"] if row["host_cpu_s"] else 0.0
        lines.append(
            {
                "file": name,
                "tests": row["tests"],
                "wall_s": round(row["wall_s"], 1),
                "cpu_busy_share": round(share, 2),
            }
        )
    tiers: dict[str, dict] = defaultdict(lambda: {"tests": 0, "wall_s": 0.0})
    for record in records:
        row = tiers[record.get("tier", "unrecorded")]  # records of before the tiers have none
        row["tests"] += 1
        row["wall_s"] += record["wall_s"]
    for tier, row in sorted(tiers.items()):
        lines.append({"tier": tier, "tests": row["tests"], "wall_s": round(row["wall_s"], 1)})
    busy = sum(r["busy_cpu_s"] for r in records)
    host = sum(r["host_cpu_s"] for r in records)
    wall = sum(r["wall_s"] for r in records)
    lines.append(
        {
            "total_wall_s": round(wall, 1),
            "tests": len(records),
            "cpu_busy_share": round(busy / host, 2) if host else 0.0,
            # core-seconds nobody used: what running tests side by side could win at most
            "idle_core_s": round(host - busy),
            "cores": os.cpu_count(),
        }
    )
    return lines


def main() -> int:
    # no abbreviations: every argument it does not know is pytest's, whole
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--summarize", type=Path, help="print the summary of a recorded tests.jsonl")
    parser.add_argument(
        "--out", type=Path, default=Path("suite_profile.jsonl"), help="where each test's record goes"
    )
    args, pytest_args = parser.parse_known_args()
    if args.summarize is not None:
        records = [json.loads(line) for line in args.summarize.read_text().splitlines()]
        rc = 0
    else:
        import pytest

        rc = int(pytest.main(["-q", "-p", "no:cacheprovider", *pytest_args], plugins=[Recorder(args.out)]))
        records = [json.loads(line) for line in args.out.read_text().splitlines()]
    for line in summarize(records):
        print(json.dumps(line))
    return rc


if __name__ == "__main__":
    sys.exit(main())
