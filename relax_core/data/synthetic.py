"""Generated tasks (``data.synthetic``): a registry of row makers and the writer of their dataset files.

A task registers its row maker with ``@synthetic_task(name)`` where it is defined. The modules that define
tasks are listed in :data:`TASK_MODULES`; the first lookup imports them, so a name resolves the same way in
every process (the driver, a Ray actor) whatever else that process imported.

A row is ``{"prompt", "label", "metadata"}``; rows with media carry them in memory under ``_media`` (images
as HWC uint8 arrays, audio as ``(waveform, rate)``) and a ``_key`` that tells apart rows with the same
prompt text. :func:`generate_synthetic` writes the media next to the dataset file (PNG with Pillow, 16-bit
WAV with soundfile) and their relative paths to the ``images`` / ``audios`` columns.
"""

from __future__ import annotations

import importlib
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_core.errors import RelaxUserError

if TYPE_CHECKING:
    from relax_core.config.schema import DataConfig

RowMaker = Callable[[random.Random, "DataConfig"], dict]

# modules whose import registers tasks (besides this one, which defines ``digits``)
TASK_MODULES = (
    "relax_core.data.synthetic_multimodal",
    "relax_core.agentic.tasks",
    "relax_core.data.synthetic_code",
)
MEDIA_COLUMN = {"image": "images", "video": "videos", "audio": "audios"}


class TaskRegistry:
    """name -> row maker ``fn(rng, data_cfg)``; the task modules are imported on the first lookup."""

    def __init__(self, modules: tuple[str, ...]) -> None:
        self._modules = modules
        self._loaded = False
        self._tasks: dict[str, RowMaker] = {}

    def register(self, name: str) -> Callable[[RowMaker], RowMaker]:
        def decorate(fn: RowMaker) -> RowMaker:
            self._tasks[name] = fn
            return fn

        return decorate

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True
            for module in self._modules:
                importlib.import_module(module)

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._tasks

    def __getitem__(self, name: str) -> RowMaker:
        self._load()
        return self._tasks[name]

    def names(self) -> list[str]:
        self._load()
        return sorted(self._tasks)


SYNTHETIC_TASKS = TaskRegistry(TASK_MODULES)
synthetic_task = SYNTHETIC_TASKS.register


@synthetic_task("digits")
def digits_row(rng: random.Random, cfg: DataConfig) -> dict:
    """``sort 31524:`` -> ``12345``: sort a random digit string (scored with per-position credit)."""
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(cfg.min_digits, cfg.max_digits)))
    return {"prompt": f"sort {digits}:", "label": "".join(sorted(digits)), "metadata": {"task": "sort"}}


def _task(cfg: DataConfig) -> Callable[[random.Random, DataConfig], dict]:
    if cfg.synthetic not in SYNTHETIC_TASKS:
        raise RelaxUserError(
            f"data.synthetic={cfg.synthetic!r} is unknown; choose one of {SYNTHETIC_TASKS.names()}"
        )
    return SYNTHETIC_TASKS[cfg.synthetic]


def first_synthetic_rows(cfg: DataConfig, seed: int, n: int) -> list[dict]:
    """The first ``n`` rows :func:`generate_synthetic` draws (in memory, media not written)."""
    make_row, rng = _task(cfg), random.Random(seed)
    return [make_row(rng, cfg) for _ in range(n)]


def generate_synthetic(cfg: DataConfig, folder: str | Path, seed: int) -> tuple[str, str]:
    """Write ``train.jsonl`` and ``eval.jsonl`` for ``cfg.synthetic``; eval prompts never occur in train."""
    make_row, rng = _task(cfg), random.Random(seed)
    eval_rows = {}
    while len(eval_rows) < cfg.num_eval:
        row = make_row(rng, cfg)
        # rows with media may share a prompt text: their "_key" tells them apart
        eval_rows[row.get("_key", row["prompt"])] = row
    train_rows = []
    for _ in range(cfg.num_train * 20):
        if len(train_rows) == cfg.num_train:
            break
        row = make_row(rng, cfg)
        if row.get("_key", row["prompt"]) not in eval_rows:
            train_rows.append(row)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, rows in (("train", train_rows), ("eval", list(eval_rows.values()))):
        rows = [write_row_media(r, folder / "media", f"{name}_{i}") for i, r in enumerate(rows)]
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(str(path))
    return paths[0], paths[1]


def write_row_media(row: dict, folder: Path, stem: str) -> dict:
    """``row`` without its in-memory ``_media``/``_key``; media files go to ``folder`` and their paths
    (relative to the dataset file, which sits in ``folder.parent``) to the ``images``/``audios`` columns."""
    media: dict[str, list[Any]] | None = row.pop("_media", None)
    row.pop("_key", None)
    if not media:
        return row
    folder.mkdir(parents=True, exist_ok=True)
    for kind, items in media.items():
        paths = []
        for j, item in enumerate(items):
            if kind == "image":
                from PIL import Image

                file = folder / f"{stem}_{j}.png"
                Image.fromarray(item).save(file)
            elif kind == "audio":
                import soundfile

                file = folder / f"{stem}_{j}.wav"
                wave, rate = item
                soundfile.write(str(file), wave, rate, subtype="PCM_16")
            else:
                raise ValueError(f"synthetic media of kind {kind!r} cannot be written")
            paths.append(f"{folder.name}/{file.name}")
        row[MEDIA_COLUMN[kind]] = paths
    return row
