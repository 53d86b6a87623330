"""Checks of a reward config made before a run starts, so a reward that cannot score stops the run with one
message instead of scoring every sample 0.0 with a logged error.

- a reward that needs a setting (``genrm``'s judge ``url``, ``remote``'s ``url``) has it;
- every configured ``url`` accepts a TCP connection (a judge or reward service that is down or mistyped);
- a reward that scores against a label has a label column: ``data.label_key`` is set and the dataset's
  first row has it.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from relax_rewards.config import RewardConfig
from relax_rewards.registry import _REGISTRY


def check_reachable(url: str, key: str, timeout_s: float = 3.0) -> None:
    """ValueError naming ``key`` unless ``url`` is http(s)://host[:port]... and its port accepts a connection."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{key}={url!r} is not an http(s)://host:port URL")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname, port), timeout=timeout_s):
            pass
    except OSError as err:
        raise ValueError(f"{key}={url!r} is not reachable: {err.strerror or err}") from None


def first_row_columns(path: str) -> set[str] | None:
    """Top-level column names of a JSONL/Parquet dataset (its first row), or None when it cannot be read
    (the dataset loader reports that itself)."""
    file = Path(path).expanduser()
    try:
        if file.suffix.lower() == ".parquet":
            import pyarrow.parquet as pq

            return set(pq.read_schema(file).names)
        with file.open() as f:
            line = next((line for line in f if line.strip()), None)
        row = json.loads(line) if line else None
    except (OSError, ValueError):
        return None
    return set(row) if isinstance(row, dict) else None


def check_reward_config(
    cfg: RewardConfig, label_key: str | None, train_path: str | None = None, probe_timeout_s: float = 3.0
) -> None:
    """ValueError naming the key to fix when the configured reward cannot score (see the module doc)."""
    name = cfg._target_ or cfg.name
    entry = _REGISTRY.get(name)
    kwargs: dict[str, Any] = dict(cfg.kwargs)
    if entry is not None and entry.needs_one_of and all(kwargs.get(k) is None for k in entry.needs_one_of):
        wanted = " or ".join(f"reward.kwargs.{k}" for k in entry.needs_one_of)
        raise ValueError(f"reward={name} needs {wanted} (e.g. reward.kwargs.url=http://host:port)")
    if kwargs.get("url"):
        check_reachable(str(kwargs["url"]), "reward.kwargs.url", probe_timeout_s)
    if entry is None or not entry.needs_label:
        return
    if not label_key:
        raise ValueError(f"reward={name} scores against a reference answer: set data.label_key")
    columns = first_row_columns(train_path) if train_path else None
    column = label_key.split(".")[0]
    if columns is not None and column not in columns:
        raise ValueError(
            f"reward={name} needs the label column data.label_key={label_key!r}, which {train_path} does not "
            f"have (its columns: {', '.join(sorted(columns))})"
        )
