"""Reads a W&B run's transaction log (``<run dir>/wandb/offline-run-*/run-<id>.wandb``) back, for tests:
wandb 0.31 ships no Python reader for it."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024  # the .wandb file is a LevelDB-style log: 32 KiB blocks of (crc, length, type) chunks
FULL, LAST = 1, 4


def wandb_records(run_file: Path) -> list[Any]:
    """The protobuf records (``wandb_internal_pb2.Record``) of a ``.wandb`` transaction log, in order."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    records, pending, pos = [], b"", 7  # 7-byte file header: ":W&B", magic, version
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a chunk header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def items(update: Any) -> dict[str, Any]:
    """{"a/b": value} of a history / summary / config update (nested keys joined by "/")."""
    return {"/".join([i.key] if i.key else list(i.nested_key)): json.loads(i.value_json) for i in update}
