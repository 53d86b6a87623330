"""Prompt datasets: generated task files, local files and Hugging Face datasets go through one loader.

``data.train_path`` (and every eval set's path) is a JSON Lines/JSON/Parquet/Arrow file or a glob of them, a
folder written by ``Dataset.save_to_disk`` (or a folder of data files), or the name of a dataset in the local
Hugging Face cache (read offline). ``data.prompt_key`` / ``label_key`` / ``metadata_key`` name the columns
(dots reach into nested objects, e.g. ``reward_model.ground_truth``). A prompt is a string or a list of chat
messages; the tokenizer's chat template is applied when it has one.

Small JSON Lines files are parsed with the standard library: ``import datasets`` costs about a second that the
default experiment and a job of a few lines should not pay. Everything else is opened with Hugging Face
``datasets`` (imported only then) as memory-mapped Arrow, and the training set's rows are tokenized when a
batch draws them, so a dataset larger than memory trains without being loaded.
"""

from __future__ import annotations

import glob
import json
import logging
import random
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_core.data.synthetic import generate_synthetic
from relax_core.errors import RelaxUserError
from relax_core.samples import PromptRecord

if TYPE_CHECKING:
    from relax_core.config.schema import DataConfig

log = logging.getLogger(__name__)

# Hugging Face ``datasets`` builder per file suffix
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
# JSON Lines files up to this size are read into a list (fast start, errors name the line); larger ones go
# through ``datasets`` (memory-mapped Arrow, converted once into the HF cache)
JSONL_IN_MEMORY_BYTES = 64 << 20


def dataset_paths(cfg: DataConfig, output_dir: str, seed: int) -> tuple[str, str | None]:
    """Train and eval datasets: the configured ones, or the synthetic task generated under the run dir."""
    if cfg.train_path:
        return cfg.train_path, cfg.eval_path
    if not cfg.synthetic:
        raise RelaxUserError(
            "data.train_path is not set and data.synthetic is null: give a dataset file, glob, "
            "save_to_disk folder or cached Hugging Face dataset name"
        )
    return generate_synthetic(cfg, Path(output_dir) / "data", seed)


def _read_jsonl(file: Path, path: str, on_error: str) -> tuple[list[dict], int]:
    """A JSON Lines file's rows (a row lacking a column lacks its key) and the number of lines dropped. A
    line that is not UTF-8, not JSON or not an object is dropped under ``on_error="skip"``, else a user
    error naming it."""
    rows, skipped = [], 0
    # bytes, decoded line by line: one bad byte names its line instead of failing the whole file
    for lineno, raw in enumerate(file.read_bytes().splitlines(), start=1):
        try:
            line = raw.decode("utf-8")
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("a row must be a JSON object")
        except UnicodeDecodeError as err:
            reason = f"not UTF-8 (byte {raw[err.start]:#04x} at column {err.start + 1})"
        except json.JSONDecodeError as err:
            reason = f"invalid JSON ({err.msg})"
        except ValueError as err:
            reason = str(err)
        else:
            rows.append(row)
            continue
        if on_error != "skip":
            raise RelaxUserError(
                f"dataset file {path!r}, line {lineno}: {reason} (fix the line or set data.on_error=skip)"
            )
        skipped += 1
        log.warning("skipping %s line %d: %s", path, lineno, reason)
    return rows, skipped


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _pick_split(dataset: Any, path: str, split: str) -> Any:
    """One split of a ``DatasetDict``: the one named, else its only one (a file or glob has only "train")."""
    import datasets

    if not isinstance(dataset, datasets.DatasetDict):
        return dataset  # a saved Dataset has no splits
    if split in dataset:
        return dataset[split]
    if len(dataset) == 1:
        return next(iter(dataset.values()))
    raise RelaxUserError(
        f"dataset {path!r} has no split {split!r}: choose one of {', '.join(dataset)} "
        "(data.split, data.eval_split, eval.sets.<name>.split)"
    )


class ArrowRows(Sequence[dict]):
    """The rows of a ``datasets.Dataset`` as dicts, each read from the memory-mapped Arrow table when indexed.

    Rows keep Arrow's storage: an Image/Audio/Video column holds ``{"bytes", "path"}``, which the processors
    read themselves (decoding here would need torchcodec and hold pixels in every row drawn)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset.with_format("arrow")
        self.columns: list[str] = list(dataset.column_names)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:  # type: ignore[override]  (by position only, no slices)
        return self.dataset[index].to_pylist()[0]


def _open_hf(path: str, split: str) -> tuple[Any, Path | None]:
    """A ``datasets.Dataset`` (memory-mapped Arrow) for ``path`` and the folder that relative media paths
    start from (None for a cached hub dataset)."""
    import datasets
    from datasets import config as hf_config

    target = Path(path).expanduser()
    local = target.exists() or _is_glob(path)
    # never the network: a hub name is looked up in the local cache only
    offline, hf_config.HF_HUB_OFFLINE = hf_config.HF_HUB_OFFLINE, True
    try:
        if target.is_dir() and any((target / f).is_file() for f in ("state.json", "dataset_dict.json")):
            dataset, base = datasets.load_from_disk(str(target)), target
        elif target.is_dir():  # a folder of data files (train-*.parquet, test.jsonl, ...)
            dataset, base = datasets.load_dataset(str(target)), target
        elif local:
            dataset = datasets.load_dataset(BUILDERS[target.suffix.lower()], data_files=str(target))
            base = next(p for p in target.parents if not _is_glob(str(p)))
        else:
            dataset, base = datasets.load_dataset(path), None
    except ConnectionError:  # what offline mode raises for a name that is not in the cache
        raise RelaxUserError(
            f"dataset {path!r} is neither a local file, glob or folder nor a dataset in the local Hugging Face "
            f"cache ({hf_config.HF_DATASETS_CACHE}); Relax does not download datasets: run "
            f"datasets.load_dataset({path!r}) once where there is network, or save_to_disk and give the folder"
        ) from None
    except Exception as err:  # noqa: BLE001  (datasets/pyarrow raise many types for one cause: the input)
        raise RelaxUserError(f"dataset {path!r} cannot be read: {_first_line(err)}") from None
    finally:
        hf_config.HF_HUB_OFFLINE = offline
    return _pick_split(dataset, path, split), base


def _is_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


def read_rows(
    path: str, cfg: DataConfig, split: str | None = None
) -> tuple[Sequence[dict], int, Path | None]:
    """A dataset's rows, the number of lines dropped (malformed JSON Lines under ``data.on_error=skip``) and
    the folder that relative media paths start from.

    Small JSON Lines files (``.json`` is read as JSON Lines too) come back as a list; everything else as
    :class:`ArrowRows` of a ``datasets.Dataset`` (``split``, null: ``data.split``). A missing path, a glob
    matching nothing, an unreadable file or a missing split is a user error naming the cause."""
    file = Path(path).expanduser()
    suffix = file.suffix.lower()
    looks_local = file.is_absolute() or path.startswith((".", "~")) or suffix in BUILDERS
    is_glob = _is_glob(path)
    if not file.exists() and looks_local and not is_glob:
        raise RelaxUserError(f"dataset file {path!r} does not exist")
    if is_glob and not glob.glob(str(file), recursive=True):
        raise RelaxUserError(f"dataset glob {path!r} matches no file")
    if (file.is_file() or is_glob) and suffix not in BUILDERS:
        raise RelaxUserError(
            f"dataset file {path!r}: unsupported format {suffix!r} (use .jsonl, .json, .parquet or .arrow, "
            "or a save_to_disk folder)"
        )
    if file.is_file() and suffix in (".jsonl", ".json") and file.stat().st_size <= JSONL_IN_MEMORY_BYTES:
        rows, skipped = _read_jsonl(file, path, cfg.on_error)
        if not rows and not skipped:
            raise RelaxUserError(f"dataset file {path!r} has no rows")
        return rows, skipped, file.parent
    dataset, base = _open_hf(path, split or cfg.split)
    if len(dataset) == 0:
        raise RelaxUserError(f"dataset {path!r} has no rows")
    return ArrowRows(dataset), 0, base


def check_columns(path: str, columns: list[str], named: dict[str, str | None]) -> None:
    """Every column a config key names (``{"data.prompt_key": "reward_model.ground_truth", ...}``; its first
    dotted part) is one of the dataset's ``columns``."""
    for key, column in named.items():
        if column is not None and column.split(".")[0] not in columns:
            raise RelaxUserError(
                f"dataset {path!r} has no column {column.split('.')[0]!r} ({key}={column!r}); "
                f"its columns: {', '.join(columns)}"
            )


def get_field(row: dict, dotted: str) -> Any:
    """``row["a"]["b"]`` for ``"a.b"``; KeyError names the missing part."""
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(part)
        value = value[part]
    return value


def prompt_messages(prompt: Any, cfg: DataConfig) -> list[dict[str, Any]]:
    """A dataset prompt (text or messages) as chat messages, with ``data.system_prompt`` in front."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(isinstance(m, dict) and "content" in m for m in prompt):
        messages = [dict(m) for m in prompt]
    else:
        raise ValueError("prompt must be a string or a list of {role, content} messages")
    if cfg.system_prompt and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": cfg.system_prompt}, *messages]
    return messages


def render_prompt(prompt: Any, tokenizer, cfg: DataConfig) -> str:
    """The text the model sees: chat template over messages when available, else the raw text."""
    messages = prompt_messages(prompt, cfg)
    if cfg.apply_chat_template and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return "\n".join(str(m["content"]) for m in messages)


MEDIA_MARKERS = {"image": "<image>", "video": "<video>", "audio": "<audio>"}


def with_media_markers(prompt: Any, items: dict[str, list]) -> Any:
    """``prompt`` with a marker per media item in front of the first user turn, when it has no markers.

    Datasets such as Open-R1 multimodal or AVQA keep media in their own columns and never mark where they
    go; the convention then is media first, then the question.
    """
    if not any(items.values()):
        return prompt
    text = prompt if isinstance(prompt, str) else " ".join(str(m.get("content", "")) for m in prompt)
    if any(marker in text for marker in MEDIA_MARKERS.values()) or "_pad|>" in text:
        return prompt
    prefix = "".join(
        MEDIA_MARKERS[kind] * len(values) for kind, values in items.items() if kind in MEDIA_MARKERS
    )
    if isinstance(prompt, str):
        return prefix + prompt
    messages = [dict(m) for m in prompt]
    first_user = next((m for m in messages if m.get("role") == "user"), messages[0])
    first_user["content"] = prefix + str(first_user["content"])
    return messages


class PromptRows:
    """A dataset's prompt records by row index, each tokenized when asked for; ``None`` for a malformed row
    under ``data.on_error=skip`` (counted in ``skipped``).

    ``template`` (an eval set's) wraps a string prompt: its ``{prompt}`` is replaced by the prompt. ``split``:
    the split read from a dataset with several (null: ``data.split``).

    ``media`` (a :class:`relax_core.data.multimodal.MediaPrompts`, for ``modality.keys``) reads each row's media
    columns and expands the placeholders in the prompt ids; records keep media references, not tensors.
    """

    def __init__(
        self,
        path: str,
        cfg: DataConfig,
        tokenizer,
        media=None,
        template: str | None = None,
        split: str | None = None,
    ) -> None:
        self.path, self.cfg, self.tokenizer, self.media, self.template = path, cfg, tokenizer, media, template
        self.rows, self.skipped_lines, self.base_dir = read_rows(path, cfg, split)
        self.bad: set[int] = set()
        # a table's columns are known up front: one error for a missing one, not one per row
        if isinstance(self.rows, ArrowRows):
            named = {"data.prompt_key": cfg.prompt_key, "data.label_key": cfg.label_key}
            if media is not None:
                named |= {f"modality.keys.{k}": c for k, c in media.modality_cfg.keys.items()}
            check_columns(path, self.rows.columns, named)

    @property
    def skipped(self) -> int:
        """Malformed lines dropped on reading and malformed rows met so far (``data.on_error=skip``)."""
        return self.skipped_lines + len(self.bad)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> PromptRecord | None:
        if index in self.bad:
            return None
        cfg, row = self.cfg, self.rows[index]
        try:
            prompt = get_field(row, cfg.prompt_key)
            if prompt is None:  # a Parquet/Arrow row without a value, or an explicit null
                raise KeyError(cfg.prompt_key)
            if self.template is not None and isinstance(prompt, str):
                prompt = self.template.replace("{prompt}", prompt)
            row_items = None
            if self.media is not None:
                row_items = self.media.row_items(row, self.base_dir) or None
                prompt = with_media_markers(prompt, row_items or {})
            text = render_prompt(prompt, self.tokenizer, cfg)
            label = get_field(row, cfg.label_key) if cfg.label_key else None
            metadata = {}
            if cfg.metadata_key and cfg.metadata_key in row and row[cfg.metadata_key] is not None:
                metadata = get_field(row, cfg.metadata_key)
                if not isinstance(metadata, dict):
                    raise ValueError(f"column {cfg.metadata_key!r} must hold an object")
            if self.media is not None:
                prompt_ids = self.media.encode(text, row_items or {})[0]
            else:
                prompt_ids = self.tokenizer(text, add_special_tokens=False).input_ids
            if not prompt_ids:
                raise ValueError("prompt is empty")
            if len(prompt_ids) > cfg.max_prompt_len:
                raise ValueError(
                    f"prompt has {len(prompt_ids)} tokens > data.max_prompt_len={cfg.max_prompt_len}"
                )
        except (KeyError, ValueError, TypeError) as err:
            reason = f"missing column {err.args[0]!r}" if isinstance(err, KeyError) else str(err)
            if cfg.on_error == "skip":
                self.bad.add(index)
                log.warning("skipping %s row %d: %s", self.path, index, reason)
                return None
            raise RelaxUserError(
                f"dataset file {self.path!r}, row {index}: {reason} (set data.on_error=skip to drop such rows)"
            ) from None
        return PromptRecord(
            index=index,
            prompt_ids=prompt_ids,
            prompt_text=text,
            label=label,
            metadata=metadata,
            media=row_items,
            messages=prompt_messages(prompt, cfg),
        )


def load_prompts(
    path: str,
    cfg: DataConfig,
    tokenizer,
    media=None,
    template: str | None = None,
    split: str | None = None,
    limit: int | None = None,
    lazy: bool = False,
) -> tuple[list[PromptRecord] | PromptRows, int]:
    """Tokenized prompt records of a dataset (the first ``limit`` well-formed ones) and the number of rows
    skipped (``data.on_error=skip``); see :class:`PromptRows` for ``media``, ``template`` and ``split``.

    ``lazy``: a dataset read through ``datasets`` comes back as its :class:`PromptRows` (rows tokenized when
    drawn, malformed ones met then), after its first row is built so that a systematic problem (a column
    of the wrong type, prompts over ``data.max_prompt_len``) stops the run before it starts. A small JSON
    Lines file is tokenized whole either way: every malformed row is reported before the run starts.
    """
    prompts = PromptRows(path, cfg, tokenizer, media, template, split)
    if lazy and isinstance(prompts.rows, ArrowRows):
        prompts[0]  # noqa: B018  (tokenizes the first row, raising on a malformed one under on_error=raise)
        return prompts, prompts.skipped
    records = []
    for index in range(len(prompts)):
        if limit is not None and len(records) == limit:
            break
        if (record := prompts[index]) is not None:
            records.append(record)
    if not records:
        raise RelaxUserError(f"dataset file {path!r}: every row was malformed ({prompts.skipped} skipped)")
    return records, prompts.skipped


class PromptStream:
    """Endless, epoch-shuffled stream of prompt batches whose position can be saved and restored.

    ``records`` is a list or a lazy :class:`PromptRows`, whose ``None`` entries (malformed rows it skips)
    the stream passes over."""

    def __init__(
        self, records: Sequence[PromptRecord | None] | PromptRows, seed: int, shuffle: bool = True
    ) -> None:
        self.records, self.seed, self.shuffle = records, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> list[int]:
        order = list(range(len(self.records)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next_batch(self, size: int) -> list[PromptRecord]:
        batch: list[PromptRecord] = []
        misses = 0
        while len(batch) < size:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order()
            record = self.records[self._order[self.position]]
            self.position += 1
            if record is not None:
                batch.append(record)
                misses = 0
                continue
            misses += 1
            # two epochs' worth of draws always span a whole epoch: not one row in it was well-formed
            if misses >= 2 * len(self._order):
                raise RelaxUserError("every row of the training set is malformed (data.on_error=skip)")
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._epoch_order()
