"""Which of Relax's files a training step passes, counted the same way each time (issue 67's yardstick).

Runs ``python -m relax_launch`` in this process (``cluster=in_process``, so every role's code runs here and a
profiler sees it; on Ray the same role code runs in other processes) with no warm-start, and stops the run at
the first policy ``loss.backward()``. Two counts per mode, as JSON lines:

- ``executed``: every Relax source file (``relax_*`` packages) with a function called (module and class
  bodies, i.e. imports, not counted), on any thread, from the launch to that backward: start-up, the
  evaluation before the first step and the step;
- ``step``: the same from the mode's step loop (``steps()``) on: the RL step alone, the launch and the
  evaluation before it left out;
- ``on_stack``: the files on some thread's stack at the moment of the backward: the call path itself.

Each with the files' line counts. ``--list`` prints the files too.

    python benchmarks/step_files.py                 # colocate and async (max_staleness=0)
    python benchmarks/step_files.py --modes colocate --list
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("relax_launch", "relax_core", "relax_models", "relax_rewards")
MODES = {
    "colocate": [],
    "async": ["mode=async", "mode.databus=memory", "mode.max_staleness=0"],
}
RUN = [
    "cluster=in_process",
    "trainer.sft_warmup_steps=0",
    "trainer.total_steps=1",
    "trainer.export_final_model=false",
    "logger=jsonl",
    "logger.plot=false",
]


class ReachedBackward(BaseException):
    """Ends the traced run at its first backward (a BaseException: the run's handlers let it through)."""


@functools.cache
def relax_file(filename: str) -> str | None:
    """``filename`` relative to the checkout when it is one of Relax's Python sources, else None."""
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    return str(rel) if rel.parts[0] in PACKAGES and rel.suffix == ".py" else None


def trace(mode: str) -> dict[str, list[str]]:
    """Run one step of ``mode`` in this process; the files executed and those on a stack at the backward."""
    import torch

    executed: set[str] = set()
    in_step: set[str] = set()
    on_stack: set[str] = set()

    def profile(frame, event, arg):  # noqa: ANN001  (sys.setprofile's signature)
        # functions only: a module's or a class's body runs as a "call" too (an import, not the step)
        if event != "call" or not frame.f_code.co_flags & inspect.CO_NEWLOCALS:
            return
        name = relax_file(frame.f_code.co_filename)
        if name:
            executed.add(name)
            if in_step or (frame.f_code.co_name == "steps" and name.startswith("relax_core/modes/")):
                in_step.add(name)  # from the mode's step loop on

    backward = torch.Tensor.backward

    def first_backward(self, *args, **kwargs):  # noqa: ANN001
        for frame in sys._current_frames().values():
            while frame is not None:
                name = relax_file(frame.f_code.co_filename)
                if name:
                    on_stack.add(name)
                frame = frame.f_back
        backward(self, *args, **kwargs)
        raise ReachedBackward

    out = tempfile.mkdtemp(prefix=f"step_files_{mode}_")
    sys.argv = ["relax_launch", *RUN, *MODES[mode], f"hydra.run.dir={out}"]
    torch.Tensor.backward = first_backward
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        import runpy

        runpy.run_module("relax_launch", run_name="__main__", alter_sys=True)
    except (ReachedBackward, SystemExit):
        pass
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        torch.Tensor.backward = backward
    if not on_stack:
        raise SystemExit(f"{mode}: the run ended without a backward (see {out})")
    return {"executed": sorted(executed), "step": sorted(in_step), "on_stack": sorted(on_stack)}


def lines(files: list[str]) -> int:
    return sum(len((ROOT / f).read_text().splitlines()) for f in files)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: colocate, async")
    parser.add_argument("--list", action="store_true", help="print each file with its line count")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: trace this mode, print JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(trace(args.one)))
        return
    for mode in args.modes.split(","):
        # one process per mode: a traced run must not find the other's modules already imported
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(
            [sys.executable, __file__, "--one", mode], capture_output=True, text=True, env=env, cwd=ROOT
        )
        if done.returncode != 0:
            raise SystemExit(done.stderr[-3000:])
        found = json.loads(done.stdout.strip().splitlines()[-1])
        for kind, files in found.items():
            record = {"mode": mode, "count": kind, "files": len(files), "lines": lines(files)}
            if args.list:
                record["list"] = {f: lines([f]) for f in files}
            print(json.dumps(record))


if __name__ == "__main__":
    main()
