"""Helpers for the resilience tests (imported by name: pytest puts this folder on sys.path): tiny runs composed from the real ``conf/`` tree, and fault injection."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig

import relax_launch.cli  # noqa: F401  (registers the structured-config schema with Hydra)

# A run small enough for a loaded 2-core machine: 2 warm-start steps, 4 prompts x 4 samples per RL step.
TINY_RUN = [
    "trainer.sft_warmup_steps=2",
    "trainer.sft_batch_size=16",
    "rollout.batch_size=4",
    "rollout.n_samples_per_prompt=4",
    "data.num_train=64",
    "data.num_eval=8",
    "trainer.eval_every=0",
    "logger=jsonl",
    "cluster.num_cpus=4",
    "rollout.num_threads=1",
    "trainer.num_threads=1",
]
# the same run without Ray (every role in the launcher's process): it takes the Ray run's steps exactly
# (tests/e2e/test_in_process.py) and starts in half the time, for runs that compare states, not processes
TINY_RUN_IN_PROCESS = [o for o in TINY_RUN if not o.startswith("cluster.")] + ["cluster=in_process"]


def compose(overrides: list[str], output_dir: Path) -> DictConfig:
    """The DictConfig ``python -m relax_launch <overrides>`` would run with, writing to ``output_dir``."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    with initialize_config_module("relax_launch.conf", version_base="1.3"):
        cfg = hydra_compose("config", overrides=overrides)
    cfg.output_dir = str(output_dir)
    return cfg


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written right now
    return out


def recovered(row: dict) -> float:
    return row.get("health/step_retries", 0) + row.get("health/global_restarts", 0)


def wait_for_row(run_dir: Path, accept: Callable[[dict], bool], what: str, timeout_s: float = 600.0) -> dict:
    """The first metrics row ``accept`` takes, once it is logged."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        row = next((r for r in read_metrics(run_dir) if accept(r)), None)
        if row is not None:
            return row
        time.sleep(0.2)
    raise TimeoutError(f"{what} not reached in {run_dir} after {timeout_s:.0f}s")


def wait_for_step(run_dir: Path, step: int, recoveries: int = 0, timeout_s: float = 600.0) -> None:
    """Until step ``step`` is logged, by a row that counts at least ``recoveries`` recoveries (step retries
    in place plus restarts from a checkpoint): a fault injected after an earlier one then meets a run that
    has handled it."""
    wait_for_row(
        run_dir,
        lambda r: r.get("step", -1) >= step and recovered(r) >= recoveries,
        f"step {step} with {recoveries} recoveries",
        timeout_s,
    )


def actor_pid(name: str, namespace: str | None = None, timeout_s: float = 120.0) -> int:
    """PID of the live Ray actor ``name`` (a role replica such as ``rollout-0``), from inside that actor;
    waits until the run has started Ray and that actor (a lookup before ``ray.init`` would start a Ray of
    its own)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if ray.is_initialized():
                handle = ray.get_actor(name, namespace=namespace)
                return ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
        except ValueError:  # not created yet
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"no live Ray actor {name!r} after {timeout_s:.0f}s")
        time.sleep(0.05)
