"""Checkpoints of a whole run, written atomically, and the ``trainer.resume`` rules.

Layout under ``<output_dir>/checkpoints/``::

    step_000040/
        meta.json          step, time, what the folder holds (written last: a folder without it is partial)
        driver.pt          data position (PromptStream), metrics history, health counters, extra driver state
        actor/backend.pt   model, optimizer, scheduler, RNG states of the Actor (its backend writes it)
        actor/dcp/, actor/fsdp_rank*.pt   instead, with trainer.fsdp: model + optimizer shards of every rank
                           (torch.distributed.checkpoint), and each rank's scheduler and RNG state
        actor/megatron_rank*.pt           instead, with trainer=megatron: one file per training rank
        rollout_0.pt ...   sampling-generator state of each rollout engine

A checkpoint is first assembled in ``.tmp-step_N`` and then renamed to ``step_N`` (a rename within one
directory is atomic on POSIX), so a job killed while saving leaves either the previous checkpoint or the new
one, never a half-written folder that ``resume=auto`` would pick. Only the newest ``keep_last`` are kept.
The folder must be on storage every node sees (the run dir is, on a cluster with a shared filesystem).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from relax_core.errors import RelaxUserError

STEP_DIR = re.compile(r"^step_(\d+)$")
META = "meta.json"
log = logging.getLogger("relax")

# Set by a preemption / time-limit handler (relax_launch.cluster.slurm): the step loop saves a checkpoint at
# the end of the current step and returns with status "preempted" so the job can requeue and resume.
STOP_REQUEST = threading.Event()


def checkpoint_root(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``root`` (those with ``meta.json``), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = STEP_DIR.match(child.name)
        if m and (child / META).is_file():
            found.append((int(m.group(1)), child))
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    ckpts = list_checkpoints(root)
    return ckpts[-1] if ckpts else None


def resolve_resume(resume: str | None, output_dir: str | os.PathLike) -> Path | None:
    """The checkpoint folder to start from: ``None``/"" none, ``auto`` the newest in the run dir (none is fine:
    a first run), a path its checkpoint (or the newest checkpoint below it when it is a checkpoints dir)."""
    if not resume:
        return None
    if resume == "auto":
        return latest_checkpoint(checkpoint_root(output_dir))
    path = Path(resume).expanduser()
    if (path / META).is_file():
        return path
    inner = latest_checkpoint(path) or latest_checkpoint(checkpoint_root(path))
    if inner is not None:
        return inner
    raise RelaxUserError(
        f"trainer.resume={resume!r}: no checkpoint there (expected a folder with {META}, "
        "a checkpoints/ dir or a run dir holding one)"
    )


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(path) / META).read_text())


class CheckpointManager:
    """Saves checkpoints every ``save_every`` steps into ``root`` and prunes all but the last ``keep_last``."""

    def __init__(self, root: str | os.PathLike, save_every: int, keep_last: int) -> None:
        self.root = Path(root)
        self.save_every = save_every
        self.keep_last = max(1, keep_last)

    def due(self, step: int, final_step: int | None = None) -> bool:
        """True when ``step`` should be saved (every ``save_every`` steps, and the final step when saving)."""
        if self.save_every <= 0:
            return False
        return step % self.save_every == 0 or step == final_step

    def save(self, step: int, write: Callable[[Path], dict[str, Any]]) -> Path:
        """Call ``write(tmp_dir)`` to fill a fresh folder, then publish it as ``step_<step>`` atomically.

        ``write`` returns extra entries for ``meta.json``. An existing checkpoint of the same step (a step
        re-run after a global restart) is replaced.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f".tmp-step_{step:06d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            extra = write(tmp) or {}
            meta = {"step": step, "saved_at": time.time(), **extra}
            (tmp / META).write_text(json.dumps(meta, indent=2))
            _fsync_dir(tmp)
            if final.exists():  # move the old one aside first so `final` never points at nothing valid
                old = self.root / f".old-step_{step:06d}-{os.getpid()}"
                final.rename(old)
                tmp.rename(final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(final)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.prune()
        return final

    def prune(self) -> None:
        ckpts = list_checkpoints(self.root)
        for old in ckpts[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        for leftover in self.root.glob(".tmp-step_*"):  # from a run killed mid-save
            if not leftover.name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(leftover, ignore_errors=True)


def save_torch(obj: Any, path: Path) -> None:
    """``torch.save`` through a temp file and rename, so a reader never sees a truncated file."""
    tmp = path.with_name(path.name + ".part")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load_torch(path: Path) -> Any:
    return torch.load(path, weights_only=False)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------- a run's state (driver side)


def save_run(controller, manager: CheckpointManager, step: int, extra: dict[str, Any] | None = None) -> Path:
    """Checkpoint every stateful piece of a run after ``step``: Actor (model, optimizer, scheduler, RNG),
    each rollout engine's sampling RNG, the data position, the metrics history and health counters."""
    import ray

    c = controller

    def write(tmp: Path) -> dict[str, Any]:
        actor_done = c.actor.call("save_checkpoint", str(tmp / "actor"))
        algo_roles = getattr(c, "algo_roles", None)  # the PPO Critic trains too
        if algo_roles is not None:
            actor_done += algo_roles.save_checkpoint(str(tmp))
        rng_states = ray.get(c.rollout.call("rng_state"))
        for i, state in enumerate(rng_states):
            save_torch(state, tmp / f"rollout_{i}.pt")
        driver = {
            "step": step,
            "stream": c.stream.state_dict(),
            "history": list(c.sink.history) if c.sink is not None else [],
            "health": c.health.state_dict() if getattr(c, "health", None) is not None else {},
            "extra": extra or {},
            "algo_updates": algo_roles.updates if algo_roles is not None else 0,
        }
        bus = getattr(c, "bus", None)  # async mode: staleness / in-flight bookkeeping when it can be saved
        if bus is not None and hasattr(bus, "state_dict"):
            driver["bus"] = bus.state_dict()
        save_torch(driver, tmp / "driver.pt")
        ray.get(actor_done)
        return {"rollout_replicas": len(rng_states), "output_dir": str(c.cfg.output_dir)}

    path = manager.save(step, write)
    log.info("checkpoint saved: %s", path)
    return path


def restore_run(controller, path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_run` into freshly started roles; returns the driver state.

    The rollout engines get the restored weights (version = step) and RNG states, the prompt stream its
    position, the metrics sink the history up to the checkpoint (later records are dropped from
    ``metrics.jsonl`` so no step appears twice).
    """
    import ray

    c, path = controller, Path(path)
    driver = load_torch(path / "driver.pt")
    step = int(driver["step"])
    ray.get(c.actor.call("load_checkpoint", str(path / "actor")))
    if getattr(c, "algo_roles", None) is not None:
        c.algo_roles.load_checkpoint(str(path), driver.get("algo_updates", 0))
    c.push_weights(version=step)
    refs = []
    for i, actor in enumerate(c.rollout.actors):
        f = path / f"rollout_{i}.pt"
        if f.is_file():  # a run resumed with more engines: the extra ones keep their fresh seeds
            refs.append(actor.set_rng_state.remote(load_torch(f)))
    ray.get(refs)
    c.stream.load_state_dict(driver["stream"])
    bus = getattr(c, "bus", None)
    if bus is not None and "bus" in driver and hasattr(bus, "load_state_dict"):
        bus.load_state_dict(driver["bus"])
    if getattr(c, "health", None) is not None and driver.get("health"):
        c.health.load_state_dict(driver["health"])
    if c.sink is not None:
        rewind_sink(c.sink, step, driver["history"])
    log.info("resumed from %s (step %d)", path, step)
    return driver


def rewind_sink(sink, step: int, history: list[dict[str, float]]) -> None:
    """Make the sink's history and ``metrics.jsonl`` end at ``step`` (the file is rewritten and reopened)."""
    sink.history = [dict(r) for r in history if r.get("step", 0) <= step]
    path = Path(sink.out) / "metrics.jsonl"
    sink.jsonl.close()
    path.write_text("".join(json.dumps(r) + "\n" for r in sink.history))
    sink.jsonl = open(path, "a")  # noqa: SIM115  (kept open for the run, like MetricsSink does)
