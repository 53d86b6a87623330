"""Checkpoints of a whole run, written atomically, and the ``trainer.resume`` rules.

Layout under ``<output_dir>/checkpoints/``::

    step_000040/
        meta.json          step, time, what the folder holds (written last: a folder without it is partial)
        driver.pt          data position (PromptStream), metrics history, health counters, extra driver state
        actor/backend.pt   model, optimizer, scheduler, RNG states of the Actor (its backend writes it)
        rollout_0.pt ...   sampling-generator state of each rollout engine

A checkpoint is first assembled in ``.tmp-step_N`` and then renamed to ``step_N`` (a rename within one
directory is atomic on POSIX), so a job killed while saving leaves either the previous checkpoint or the new
one, never a half-written folder that ``resume=auto`` would pick. Only the newest ``keep_last`` are kept.
The folder must be on storage every node sees (the run dir is, on a cluster with a shared filesystem).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from relax_core.errors import RelaxUserError

STEP_DIR = re.compile(r"^step_(\d+)$")
META = "meta.json"


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


def truncate_metrics_file(path: str | os.PathLike, last_step: int) -> int:
    """Drop records of steps after ``last_step`` from a ``metrics.jsonl`` (steps run after the checkpoint
    that a resumed run will run again); returns how many lines were dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    keep, dropped = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            step = json.loads(line).get("step", 0)
        except json.JSONDecodeError:  # a line cut by a kill mid-write
            dropped += 1
            continue
        if step <= last_step:
            keep.append(line)
        else:
            dropped += 1
    tmp = path.with_name(path.name + ".part")
    tmp.write_text("".join(f"{ln}\n" for ln in keep))
    os.replace(tmp, path)
    return dropped


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
