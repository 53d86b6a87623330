"""Prompt datasets: generated task files and real JSONL/Parquet files go through one loader.

Rows are read from local JSON Lines or Parquet files; ``data.prompt_key`` / ``label_key`` /
``metadata_key`` name the columns (dots reach into nested objects, e.g. ``reward_model.ground_truth``).
A prompt is a string or a list of chat messages; the tokenizer's chat template is applied when it has one.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_core.errors import RelaxUserError
from relax_core.samples import PromptRecord
from relax_core.synthetic import generate_synthetic

if TYPE_CHECKING:
    from relax_core.config import DataConfig

log = logging.getLogger(__name__)


def dataset_paths(cfg: DataConfig, output_dir: str, seed: int) -> tuple[str, str | None]:
    """Train and eval files: the configured ones, or the synthetic task generated under the run dir."""
    if cfg.train_path:
        return cfg.train_path, cfg.eval_path
    if not cfg.synthetic:
        raise RelaxUserError("data.train_path is not set and data.synthetic is null: give a dataset file")
    return generate_synthetic(cfg, Path(output_dir) / "data", seed)


def _read_rows(path: str, on_error: str = "raise") -> tuple[list[dict], int]:
    """A file's rows and the number of lines dropped: JSON Lines as written (a row lacking a column lacks
    its key), Parquet with every column in every row (null where a row has no value). A line that is not
    UTF-8, not JSON or not an object is dropped under ``on_error="skip"``, else a user error naming it.

    JSON Lines are parsed with the standard library: Hugging Face ``datasets`` would pull pandas and pyarrow
    (~80 MB) into the driver for a job of a few lines."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise RelaxUserError(f"dataset file {path!r} does not exist")
    suffix = file.suffix.lower()
    if suffix not in (".jsonl", ".json", ".parquet"):
        raise RelaxUserError(f"dataset file {path!r}: unsupported format {suffix!r} (use .jsonl or .parquet)")
    skipped = 0
    if suffix == ".parquet":
        import pyarrow.parquet

        try:
            rows = pyarrow.parquet.read_table(file).to_pylist()
        except Exception as err:  # noqa: BLE001  (pyarrow raises many types for one cause)
            first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise RelaxUserError(f"dataset file {path!r} cannot be read: {first_line}") from None
    else:
        rows = []
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
    if not rows and not skipped:
        raise RelaxUserError(f"dataset file {path!r} has no rows")
    return rows, skipped


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


def load_prompts(
    path: str, cfg: DataConfig, tokenizer, media=None, template: str | None = None
) -> tuple[list[PromptRecord], int]:
    """Tokenized prompt records of a file and the number of rows skipped (``data.on_error=skip``).

    ``template`` (an eval set's) wraps a string prompt: its ``{prompt}`` is replaced by the prompt.

    ``media`` (a :class:`relax_core.multimodal.MediaPrompts`, for ``modality.keys``) reads each row's media
    columns and expands the placeholders in the prompt ids; records keep media references, not tensors.
    """
    rows, skipped = _read_rows(path, cfg.on_error)
    records = []
    for index, row in enumerate(rows):
        try:
            prompt = get_field(row, cfg.prompt_key)
            if prompt is None:  # a Parquet row without a value, or an explicit null
                raise KeyError(cfg.prompt_key)
            if template is not None and isinstance(prompt, str):
                prompt = template.replace("{prompt}", prompt)
            row_items = None
            if media is not None:
                row_items = media.row_items(row, Path(path).expanduser().parent) or None
                prompt = with_media_markers(prompt, row_items or {})
            text = render_prompt(prompt, tokenizer, cfg)
            label = get_field(row, cfg.label_key) if cfg.label_key else None
            metadata = {}
            if cfg.metadata_key and cfg.metadata_key in row and row[cfg.metadata_key] is not None:
                metadata = get_field(row, cfg.metadata_key)
                if not isinstance(metadata, dict):
                    raise ValueError(f"column {cfg.metadata_key!r} must hold an object")
            if media is not None:
                prompt_ids = media.encode(text, row_items or {})[0]
            else:
                prompt_ids = tokenizer(text, add_special_tokens=False).input_ids
            if not prompt_ids:
                raise ValueError("prompt is empty")
            if len(prompt_ids) > cfg.max_prompt_len:
                raise ValueError(
                    f"prompt has {len(prompt_ids)} tokens > data.max_prompt_len={cfg.max_prompt_len}"
                )
        except (KeyError, ValueError, TypeError) as err:
            reason = f"missing column {err.args[0]!r}" if isinstance(err, KeyError) else str(err)
            if cfg.on_error == "skip":
                skipped += 1
                log.warning("skipping %s row %d: %s", path, index, reason)
                continue
            raise RelaxUserError(
                f"dataset file {path!r}, row {index}: {reason} (set data.on_error=skip to drop such rows)"
            ) from None
        records.append(
            PromptRecord(
                index=index,
                prompt_ids=prompt_ids,
                prompt_text=text,
                label=label,
                metadata=metadata,
                media=row_items,
                messages=prompt_messages(prompt, cfg),
            )
        )
    if not records:
        raise RelaxUserError(f"dataset file {path!r}: every row was malformed ({skipped} skipped)")
    return records, skipped


class PromptStream:
    """Endless, epoch-shuffled stream of prompt batches whose position can be saved and restored."""

    def __init__(self, records: list[PromptRecord], seed: int, shuffle: bool = True) -> None:
        self.records, self.seed, self.shuffle = records, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> list[int]:
        order = list(range(len(self.records)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next_batch(self, size: int) -> list[PromptRecord]:
        batch = []
        while len(batch) < size:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order()
            batch.append(self.records[self._order[self.position]])
            self.position += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._epoch_order()
