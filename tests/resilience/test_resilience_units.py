"""Checkpoint folders, resume rules, notifications, health bookkeeping: fast, no Ray."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from relax_core.errors import RelaxUserError
from relax_core.resilience.checkpoint import (
    CheckpointManager,
    checkpoint_root,
    latest_checkpoint,
    list_checkpoints,
    read_meta,
    resolve_resume,
)
from relax_core.telemetry.notify import Notifier


def _write(tmp: Path) -> dict:
    (tmp / "payload.txt").write_text("x")
    return {"kind": "test"}


def test_checkpoints_are_published_whole_and_pruned_to_keep_last(tmp_path: Path) -> None:
    manager = CheckpointManager(checkpoint_root(tmp_path), save_every=2, keep_last=2)
    assert [s for s in range(1, 7) if manager.due(s)] == [2, 4, 6]
    for step in (2, 4, 6):
        manager.save(step, _write)
    names = [p.name for p in list_checkpoints(manager.root)]
    assert names == ["step_000004", "step_000006"]
    assert read_meta(latest_checkpoint(manager.root)) | {"saved_at": 0} == {
        "step": 6,
        "saved_at": 0,
        "kind": "test",
        "files": {"payload.txt": 1},  # what resume checks the folder against
    }
    assert not list(manager.root.glob(".tmp-*"))


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    manager = CheckpointManager(checkpoint_root(tmp_path), save_every=1, keep_last=3)
    manager.save(1, _write)

    def crash(tmp: Path) -> dict:
        (tmp / "half").write_text("partial")
        raise KeyboardInterrupt  # what a kill during the write looks like to this process

    with pytest.raises(KeyboardInterrupt):
        manager.save(2, crash)
    # a folder left by a process killed outright (no cleanup ran) is not a checkpoint either
    (manager.root / "step_000003").mkdir()
    (manager.root / "step_000003" / "actor").mkdir()
    assert latest_checkpoint(manager.root).name == "step_000001"
    assert resolve_resume("auto", tmp_path).name == "step_000001"


def test_resume_rules(tmp_path: Path) -> None:
    assert resolve_resume(None, tmp_path) is None
    assert resolve_resume("auto", tmp_path) is None  # first run of a command: nothing to resume, no error
    manager = CheckpointManager(checkpoint_root(tmp_path), save_every=1, keep_last=5)
    first = manager.save(1, _write)
    manager.save(2, _write)
    assert resolve_resume(str(first), "/elsewhere") == first  # an explicit checkpoint folder
    assert resolve_resume(str(tmp_path), "/elsewhere").name == "step_000002"  # another run's dir
    with pytest.raises(RelaxUserError, match="trainer.resume"):
        resolve_resume(str(tmp_path / "nope"), tmp_path)


def _write_pt(tmp: Path) -> dict:
    import torch

    torch.save({"w": torch.arange(64)}, tmp / "driver.pt")
    return {}


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [
        (lambda c: (c / "driver.pt").write_bytes((c / "driver.pt").read_bytes()[:100]), "driver.pt"),
        (lambda c: (c / "driver.pt").unlink(), "driver.pt"),
        (lambda c: (c / "meta.json").write_text('{"step": 2,'), "meta.json"),
    ],
)
def test_a_corrupt_newest_checkpoint_falls_back_to_the_newest_intact_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, corrupt, reason: str
) -> None:
    manager = CheckpointManager(checkpoint_root(tmp_path), save_every=1, keep_last=5)
    manager.save(1, _write_pt)
    newest = manager.save(2, _write_pt)
    corrupt(newest)
    with caplog.at_level("WARNING", logger="relax"):
        assert resolve_resume("auto", tmp_path).name == "step_000001"
    assert any("step_000002" in r.message and reason in r.message for r in caplog.records), caplog.text
    with pytest.raises(RelaxUserError, match=rf"trainer.resume=.*step_000002.*{reason}") as err:
        resolve_resume(str(newest), tmp_path)  # asked for by name: no silent substitute
    assert "\n" not in str(err.value)
    corrupt(manager.root / "step_000001")
    with pytest.raises(RelaxUserError, match="no intact checkpoint"):
        resolve_resume("auto", tmp_path)


def test_notifications_reach_a_relaxfile_target(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "notify.jsonl"
    notifier = Notifier([f"relaxfile://{target}"], run_name="unit")
    assert notifier.send("start", "hello")
    assert notifier.send("failure", "boom\nreport")
    records = [json.loads(line) for line in target.read_text().splitlines()]
    assert [r["type"] for r in records] == ["info", "failure"]
    assert records[0]["title"].startswith("[relax] unit: start")
    assert records[1]["body"] == "boom\nreport"


def test_a_bad_notify_url_is_one_clear_error() -> None:
    with pytest.raises(RelaxUserError, match="logger.notify_urls"):
        Notifier(["definitely-not-a-scheme://x"])


def test_empty_notify_list_sends_nothing(tmp_path: Path) -> None:
    assert Notifier([]).send("start", "x")
    assert not os.listdir(tmp_path)
