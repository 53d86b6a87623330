"""Checkpoints of a whole run, written atomically, and the ``trainer.resume`` rules.

Layout under ``<output_dir>/checkpoints/``::

    step_000040/
        meta.json          step, time, size of every file (written last: a folder without it is partial)
        driver.pt          data position (PromptStream), metrics history, health counters, extra driver state
        actor/backend.pt   model, optimizer, scheduler, RNG states of the Actor (its backend writes it)
        actor/dcp/, actor/fsdp_rank*.pt   instead, with trainer.fsdp: model + optimizer shards of every rank
                           (torch.distributed.checkpoint), and each rank's scheduler and RNG state
        actor/megatron_rank*.pt           instead, with trainer=megatron: one file per training rank
        rollout_0.pt ...   sampling-generator state of each rollout engine

A checkpoint is first assembled in ``.tmp-step_N`` and then renamed to ``step_N`` (a rename within one
directory is atomic on POSIX), so a job killed while saving leaves either the previous checkpoint or the new
one, never a half-written folder that ``resume=auto`` would pick. Only the newest ``keep_last`` are kept.
The folder must be on storage every node sees: a run on several Ray nodes checks that at launch
(:func:`check_shared_dir`).
A published checkpoint whose files no longer match ``meta.json`` (truncated, deleted, a broken torch
archive) is corrupt: ``resume=auto`` and global restarts skip it for the newest intact one, with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from relax_core.errors import RelaxUserError, disk_full, nonfinite_weights_error

STEP_DIR = re.compile(r"^step_(\d+)$")
META = "meta.json"
log = logging.getLogger("relax")

# Set by a preemption / time-limit handler (relax_launch.cluster.slurm): the step loop saves a checkpoint at
# the end of the current step and returns with status "preempted" so the job can requeue and resume.
STOP_REQUEST = threading.Event()


def checkpoint_root(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / "checkpoints"


def check_shared_dir(path: str | os.PathLike, setting: str, timeout_s: float = 120.0) -> None:
    """On a Ray cluster of several nodes, refuse folder ``path`` (named by ``setting``) unless every node
    with resources for the roles sees it: ranks on any node write their checkpoint shards there and read
    the model folder. A marker file written here is looked for by a task pinned to each node. Nothing is
    asked of a single-node cluster."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [
        n
        for n in ray.nodes()
        if n["Alive"] and (n["Resources"].get("CPU", 0) > 0 or n["Resources"].get("GPU", 0) > 0)
    ]
    if len(nodes) < 2:
        return
    path = Path(path).resolve()
    token = uuid.uuid4().hex
    marker = path / f".relax-shared-{token}"
    marker.write_text(token)
    try:
        sees = ray.remote(num_cpus=0)(_holds_token)
        refs = [
            sees.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
                str(marker), token
            )
            for n in nodes
        ]
        seen = ray.get(refs, timeout=timeout_s)
    finally:
        marker.unlink(missing_ok=True)
    blind = sorted(n["NodeManagerAddress"] for n, ok in zip(nodes, seen, strict=True) if not ok)
    if blind:
        raise RelaxUserError(
            f"{setting}={path} is not visible from Ray node(s) {', '.join(blind)} of this {len(nodes)}-node "
            f"cluster (a file written there is missing on them), yet ranks on every node write checkpoints "
            f"under it: set {setting} to a folder on a filesystem every node mounts (NFS, Lustre, ...)"
        )


def _holds_token(marker: str, token: str) -> bool:
    """Whether ``marker`` holds ``token`` as seen from this process's node."""
    try:
        return Path(marker).read_text() == token
    except OSError:
        return False


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


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """Why checkpoint folder ``path`` cannot be loaded (one line), or None when it is intact: ``meta.json``
    parses, every file it lists has its recorded size, and each torch file's archive directory reads."""
    path = Path(path)
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as err:
        return f"{META} is unreadable ({err})"
    if not isinstance(meta, dict):
        return f"{META} is not a JSON object"
    for name, size in (meta.get("files") or {}).items():  # checkpoints older than the manifest lack it
        file = path / name
        try:
            actual = file.stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, {size} were written"
        if file.suffix == ".pt" and not zipfile.is_zipfile(file):  # torch.save writes a zip archive
            return f"{name} is not a readable torch file"
    return None


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest intact checkpoint under ``root``; corrupt newer ones are skipped with a warning. None when
    there is none at all; a user error when there are some and every one is corrupt."""
    ckpts = list_checkpoints(root)
    problems = []
    for path in reversed(ckpts):
        problem = checkpoint_problem(path)
        if problem is None:
            if problems:
                log.warning("resuming from %s instead: %s", path.name, "; ".join(problems))
            return path
        problems.append(f"checkpoint {path} is corrupt ({problem})")
        log.warning("%s, skipping it", problems[-1])
    if ckpts:
        raise RelaxUserError(
            f"no intact checkpoint under {root}: {problems[0]}; delete the corrupt folders or set trainer.resume=null"
        )
    return None


def resolve_resume(resume: str | None, output_dir: str | os.PathLike) -> Path | None:
    """The checkpoint folder to start from: ``None``/"" none, ``auto`` the newest in the run dir (none is fine:
    a first run), a path its checkpoint (or the newest checkpoint below it when it is a checkpoints dir)."""
    if not resume:
        return None
    if resume == "auto":
        return latest_checkpoint(checkpoint_root(output_dir))
    path = Path(resume).expanduser()
    if (path / META).is_file():
        problem = checkpoint_problem(path)
        if problem is not None:
            raise RelaxUserError(
                f"trainer.resume={resume!r}: checkpoint {path.name} is corrupt ({problem}); "
                "point it at an older checkpoint folder or at the run dir (the newest intact one)"
            )
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
            files = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
            meta = {"step": step, "saved_at": time.time(), **extra, "files": files}
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
        except BaseException as err:
            shutil.rmtree(tmp, ignore_errors=True)
            full = disk_full(err, self.root)
            if full is None:
                raise
            raise full from None
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


def refuse_nonfinite_policy(roles, path: str | os.PathLike) -> None:
    """Raise :class:`RunFailedError` here, in the driver, before ``path`` is written from an Actor whose
    weights hold NaN or inf: the Actor refuses too, but its error reaches the command line under Ray's
    ``ray::...`` header instead of as one line naming the cause."""
    count, example = roles.actor.call_collective("count_nonfinite_weights")
    if count:
        raise nonfinite_weights_error(str(path), count, example)


def save_run(roles, manager: CheckpointManager, step: int, driver: dict[str, Any]) -> Path:
    """Checkpoint every stateful piece of a run after ``step``: the Actor (model, optimizer, scheduler,
    RNG), the Critic and the Reference's weights when there are, each rollout engine's sampling RNG, and ``driver`` — the run
    loop's own state (data position, metrics history, health counters, mode state)."""
    from relax_core.runtime import handles

    def write(tmp: Path) -> dict[str, Any]:
        trainers = roles.actor.call("save_checkpoint", str(tmp / "actor"))
        if roles.critic is not None:  # the PPO Critic trains too; the Teacher is frozen
            trainers += roles.critic.call("save_checkpoint", str(tmp / "critic"))
        if roles.reference is not None:  # the warm-started (or last updated) policy, not the Actor's
            trainers += roles.reference.call("save_checkpoint", str(tmp / "reference"))
        rng_states = handles.get(roles.rollout.call("rng_state"))
        for i, state in enumerate(rng_states):
            save_torch(state, tmp / f"rollout_{i}.pt")
        save_torch({"step": step, **driver}, tmp / "driver.pt")
        handles.get(trainers)
        return {"rollout_replicas": len(rng_states)}

    refuse_nonfinite_policy(roles, manager.root / f"step_{step:06d}")
    path = manager.save(step, write)
    log.info("checkpoint saved: %s", path)
    return path


def restore_run(roles, path: str | os.PathLike, publish: Callable[[int], None]) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_run` into freshly started ``roles``; ``publish(step)`` then
    gives every weight consumer the restored policy, and the rollout engines get their RNG states back.
    Returns the driver state for the run loop to restore."""
    from relax_core.runtime import handles

    path = Path(path)
    try:
        driver = load_torch(path / "driver.pt")
    except Exception as err:  # noqa: BLE001  (torch raises many types for a damaged file)
        raise RelaxUserError(
            f"checkpoint {path} cannot be loaded: driver.pt: {(str(err).splitlines() or [''])[0]}; "
            "delete that folder to resume from the one before it"
        ) from None
    step = int(driver["step"])
    refs = roles.actor.call("load_checkpoint", str(path / "actor"))
    if roles.critic is not None:
        refs += roles.critic.call("load_checkpoint", str(path / "critic"))
    if roles.reference is not None and (path / "reference").is_dir():
        refs += roles.reference.call("load_checkpoint", str(path / "reference"))
    handles.get(refs)
    publish(step)
    refs = []
    for i, actor in enumerate(roles.rollout.actors):
        f = path / f"rollout_{i}.pt"
        if f.is_file():  # a run resumed with more engines: the extra ones keep their fresh seeds
            refs.append(actor.set_rng_state.remote(load_torch(f)))
    handles.get(refs)
    log.info("resumed from %s (step %d)", path, step)
    return driver


def rewind_sink(sink, step: int, history: list[dict[str, float]]) -> None:
    """Make the sink's history and ``metrics.jsonl`` end at ``step`` (the file is rewritten and reopened)."""
    sink.history = [dict(r) for r in history if r.get("step", 0) <= step]
    path = Path(sink.out) / "metrics.jsonl"
    sink.jsonl.close()
    path.write_text("".join(json.dumps(r) + "\n" for r in sink.history))
    sink.jsonl = open(path, "a")  # noqa: SIM115  (kept open for the run, like MetricsSink does)
