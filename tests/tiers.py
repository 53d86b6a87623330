"""The two test tiers: ``tests/run.sh --quick`` (pytest ``--quick``) runs every test that starts no Ray,
launches no ``relax_launch`` or engine server, and builds no Slurm or network-namespace cluster;
``tests/run.sh`` runs them all.

A test is heavy by what it uses, not by a list: a fixture declared with :func:`heavy`, or a ``slow``,
``slurm`` or ``multinode`` marker. In the quick tier :func:`guard` makes starting Ray, launching those
commands or creating a network namespace fail the test, so a heavy test nobody declared fails there
instead of silently slowing the tier down.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest

HEAVY_MARKERS = ("slow", "slurm", "multinode")
# `python -m` of these starts a run or an engine server
HEAVY_MODULES = (
    "relax_launch",
    "relax_core.engines.http_server",
    "relax_core.engines.vllm_server",
    "sglang.launch_server",
    "vllm",
)
SLURM_COMMANDS = {"sbatch", "srun", "salloc", "slurmctld", "slurmd"}
HOW_TO = (
    "the quick tier (tests/run.sh --quick) runs no such test: use a fixture declared with @heavy "
    "(tests/tiers.py; e.g. ray_cluster, relax_launch_cmd) or mark the test slow"
)

F = TypeVar("F", bound=Callable[..., Any])


def heavy(what: str) -> Callable[[F], F]:
    """Declares a fixture heavy (``what`` it starts): every test that uses it, directly or through another
    fixture, is left out of the quick tier. Put it under ``@pytest.fixture``."""

    def declare(fixture: F) -> F:
        fixture.heavy = what  # type: ignore[attr-defined]
        return fixture

    return declare


def heavy_reasons(item: pytest.Item) -> list[str]:
    """Why ``item`` is heavy: its heavy markers and the heavy fixtures it uses (empty: quick)."""
    reasons = [f"marked {name}" for name in HEAVY_MARKERS if item.get_closest_marker(name)]
    info = getattr(item, "_fixtureinfo", None)  # every fixture of a test function's closure, defined
    for name, defs in info.name2fixturedefs.items() if info else ():
        # the last definition is the one this item gets (a fixture may override another of its name)
        what = getattr(defs[-1].func, "heavy", None)
        if what:
            reasons.append(f"{name}: {what}")
    return reasons


def heavy_command(args: Any) -> str | None:
    """What a ``subprocess.Popen(args)`` would start that the quick tier runs none of, else None."""
    if isinstance(args, str):
        argv = shlex.split(args)
    else:
        argv = [str(os.fspath(a)) for a in (args if isinstance(args, Sequence) else [args])]
    for flag, value in zip(argv, argv[1:]):
        if flag == "-m" and any(value == m or value.startswith(m + ".") for m in HEAVY_MODULES):
            return f"launches `python -m {value}`"
        if flag == "-c" and "ray.init" in value:
            return "starts Ray in a Python subprocess"
    program = os.path.basename(argv[0]) if argv else ""
    if program in SLURM_COMMANDS:
        return f"runs Slurm's {program}"
    if program == "ip" and argv[1:3] == ["netns", "add"]:
        return "creates a network namespace"
    if program == "ray" and argv[1:2] == ["start"]:
        return "starts a Ray node (`ray start`)"
    return None


@contextmanager
def guard() -> Iterator[None]:
    """While open, ``ray.init`` and the Popen of a heavy command fail the test that calls them."""
    import ray

    popen_init = subprocess.Popen.__init__

    def no_ray(*args: Any, **kwargs: Any) -> None:
        pytest.fail(f"this test starts Ray (ray.init); {HOW_TO}")

    def checked_popen(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        what = heavy_command(args)
        if what:
            pytest.fail(f"this test {what}; {HOW_TO}")
        popen_init(self, args, *rest, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ray, "init", no_ray)
        patch.setattr(subprocess.Popen, "__init__", checked_popen)
        yield
