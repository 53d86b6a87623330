"""Default torch threads per role: the processes computing at the same moment hold no more threads than the
node has cores (relax_core/modes/base.py: resolve_threads)."""

from __future__ import annotations

import os

import pytest
from hydra import compose, initialize_config_module

import relax_launch.cli  # noqa: F401  (registers the schema)
from relax_core.modes.base import resolve_threads


def _resolved(overrides: list[str], cores: int, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    with initialize_config_module("relax_launch.conf", version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    resolve_threads(cfg)
    return cfg.rollout.num_threads, cfg.trainer.num_threads


@pytest.mark.parametrize(
    ("overrides", "cores", "threads"),
    [
        ([], 8, (8, 8)),  # colocate: the engine and the Actor take turns, each with every core
        (["trainer=fsdp"], 8, (8, 4)),  # two FSDP ranks train at once
        (["trainer=fsdp"], 2, (2, 1)),
        (["rollout.num_engines=2"], 8, (4, 8)),  # two engines generate at once
        (["mode=async"], 8, (4, 4)),  # engine and Actor at once
        (["mode=async", "trainer=fsdp"], 8, (2, 2)),  # one engine and two ranks at once
        (["mode=async", "trainer=fsdp"], 2, (1, 1)),  # never fewer than one
        (["trainer=fsdp", "trainer.num_threads=3"], 8, (8, 3)),  # set by hand: kept
    ],
)
def test_threads_per_role_split_the_cores_among_what_runs_at_once(
    overrides: list[str], cores: int, threads: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _resolved(overrides, cores, monkeypatch) == threads
