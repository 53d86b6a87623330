"""Checks of a reward config made before a run starts, so a reward that cannot score stops the run with one
message instead of scoring every sample 0.0 with a logged error.

- a reward that needs a setting (``genrm``'s judge ``url``, ``remote``'s ``url``) has it;
- every configured ``url`` accepts a TCP connection (a judge or reward service that is down or mistyped);
- a reward that scores against a label has a label column: ``data.label_key`` is set and the dataset's
  first row has it;
- a custom reward (``reward._target_``) imports, accepts ``(response, label, metadata)``, scores at least
  one probe and times out on none: the dataset's first rows (a synthetic task's first draws), each answered
  with its own label, scored by the configured runner (so a probe that hangs or exits cannot take the
  launcher with it). A probe that outlasts ``reward.timeout_s`` would cost that on every sample of the run.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from relax_rewards.config import JudgeConfig, RewardConfig
from relax_rewards.registry import _REGISTRY

NUM_PROBES = 4


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


def first_rows(path: str, n: int) -> list[dict[str, Any]]:
    """Up to ``n`` leading rows of a JSONL/Parquet dataset; [] when it cannot be read."""
    file = Path(path).expanduser()
    try:
        if file.suffix.lower() == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(file).slice(0, n).to_pylist()
        rows = []
        with file.open() as f:
            for line in f:
                if line.strip():
                    rows.append(json.loads(line))
                if len(rows) == n:
                    break
    except (OSError, ValueError):
        return []
    return [r for r in rows if isinstance(r, dict)]


def _field(row: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        row = row.get(part) if isinstance(row, dict) else None
    return row


ProbeRows = tuple[str, list[dict[str, Any]]]


def check_custom_reward(
    cfg: RewardConfig, label_key: str | None, train_path: str | None, probe_rows: ProbeRows | None = None
) -> None:
    """ValueError naming the reward and the cause when ``reward._target_`` cannot score at all, or times out.

    ``probe_rows`` (where they come from, the rows) replace the first rows of ``train_path``.
    """
    from relax_rewards.executor import RewardExecutor, RewardItem
    from relax_rewards.plugins import is_group_reward, load_custom

    target = cfg._target_
    if not target:
        return
    try:
        fn = load_custom(target)
    except Exception as err:  # noqa: BLE001 - any import failure is the user's to fix, in one line
        raise ValueError(f"reward._target_={target!r} cannot be loaded: {err}") from None
    try:
        inspect.signature(fn).bind(None, None, None, **dict(cfg.kwargs))
    except TypeError as err:
        raise ValueError(
            f"reward._target_={target!r} cannot be called as {getattr(fn, '__name__', 'fn')}(response, label, "
            f"metadata, **reward.kwargs): {err}"
        ) from None
    except ValueError:  # no signature to inspect (a builtin); the probes below still call it
        pass
    source, rows = probe_rows or (train_path, first_rows(train_path, NUM_PROBES) if train_path else [])
    if not rows:
        return  # nothing to probe with; the run counts its reward errors
    labels = [_field(r, label_key) if label_key else None for r in rows]
    # each probe answers with its own label: a reward that cannot score even that scores nothing
    items = [RewardItem(f"probe{i}", str(lab), lab, {}, group_id=0) for i, lab in enumerate(labels)]
    if not is_group_reward(fn):
        items = [dataclasses.replace(it, group_id=i) for i, it in enumerate(items)]
    probe_cfg = dataclasses.replace(cfg, num_workers=min(cfg.num_workers, 1))
    with RewardExecutor(probe_cfg) as ex:
        outcomes = ex.score(items)
    probes = f"(the first rows of {source}, each answered with its own label)"
    timeouts = sum(o.error == "timeout" for o in outcomes)
    if timeouts:
        raise ValueError(
            f"reward._target_={target!r} timed out (reward.timeout_s={cfg.timeout_s:g}) on {timeouts} of "
            f"{len(items)} probes {probes}: raise reward.timeout_s if it is only slow"
        )
    if all(o.error is not None for o in outcomes):
        why = outcomes[0].error.removeprefix("exception: ")
        raise ValueError(
            f"reward._target_={target!r} cannot score: it failed ({why}) on all {len(items)} probes {probes}"
        )


def check_reward_config(
    cfg: RewardConfig,
    label_key: str | None,
    train_path: str | None = None,
    probe_timeout_s: float = 3.0,
    probe_rows: ProbeRows | None = None,
) -> None:
    """ValueError naming the key to fix when the configured reward cannot score (see the module doc);
    ``probe_rows`` as in :func:`check_custom_reward`."""
    name = cfg._target_ or cfg.name
    entry = _REGISTRY.get(name)
    kwargs: dict[str, Any] = dict(cfg.kwargs)
    judge = cfg.judge if isinstance(cfg.judge, dict) else vars(cfg.judge or JudgeConfig())
    managed = bool(judge.get("path") or judge.get("model"))  # the run starts it and sets kwargs.url
    missing = (
        entry is not None and entry.needs_one_of and all(kwargs.get(k) is None for k in entry.needs_one_of)
    )
    if missing and not managed:
        wanted = " or ".join(f"reward.kwargs.{k}" for k in entry.needs_one_of)
        hint = "reward.judge.path=<HF folder> or " if name == "genrm" else ""
        raise ValueError(f"reward={name} needs {wanted} (e.g. {hint}reward.kwargs.url=http://host:port)")
    if kwargs.get("url"):
        check_reachable(str(kwargs["url"]), "reward.kwargs.url", probe_timeout_s)
    check_custom_reward(cfg, label_key, train_path, probe_rows)
    if entry is not None and entry.check is not None:
        entry.check(kwargs)
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
