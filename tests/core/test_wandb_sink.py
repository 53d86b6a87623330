"""The W&B sink writes a real offline run; its transaction log (``run-<id>.wandb``) is read back here.

No network: without ``WANDB_API_KEY`` or a netrc entry the sink runs W&B offline, which these tests pin by
pointing ``NETRC`` at an empty folder's file.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf
from wandb_reader import items, wandb_records

from relax_core.config.schema import RelaxConfig
from relax_core.telemetry.metrics import MetricsSink, wandb_mode


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "RELAX_SWEEP_GROUP"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no.netrc"))
    for key in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(key, str(tmp_path / "wandb_home"))


def test_wandb_mode_is_offline_unless_logged_in(offline, tmp_path, monkeypatch):
    assert wandb_mode() == "offline"
    (tmp_path / "no.netrc").write_text("machine api.wandb.ai login user password k3y\n")
    assert wandb_mode() == "online"  # `wandb login` wrote this entry
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"  # the user's own setting wins


def test_wandb_sink_logs_config_metrics_plot_and_eval_table(offline, tmp_path):
    cfg = RelaxConfig()
    cfg.output_dir, cfg.logger.name = str(tmp_path), "wandb"
    resolved = OmegaConf.to_container(OmegaConf.structured(cfg))
    sink = MetricsSink(cfg, resolved)
    sink.log(0, {"eval/accuracy": 0.125})
    for step, reward in [(1, 0.25), (2, 0.5)]:
        sink.log(step, {"reward/mean": reward, "reward/std": 0.1, "loss": -reward})
    sets = {"heldout": {"accuracy": 0.5, "pass@4": 0.75}}
    sink.finish(
        {"status": "finished", "eval_accuracy_final": 0.5, "eval_sets_start": {}, "eval_sets_final": sets}
    )
    import wandb

    # run.finish() returns once W&B's service has the exit record, and the service closes the run's file
    # after that; the end of a process does this teardown by itself
    wandb.teardown()

    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    records = wandb_records(run_file)
    kinds = [r.WhichOneof("record_type") for r in records]
    (run,) = [r.run for r in records if r.HasField("run")]
    config = items(run.config.update)
    assert config["trainer"]["lr"] == cfg.trainer.lr and config["seed"] == cfg.seed
    assert run.project == "relax" and run.run_group == ""
    history = {int(r.history.step.num): items(r.history.item) for r in records if r.HasField("history")}
    assert sorted(history) == [0, 1, 2]
    assert history[0]["eval/accuracy"] == 0.125
    assert [history[s]["reward/mean"] for s in (1, 2)] == [0.25, 0.5]
    assert history[2]["reward_curve/_type"] == "image-file"
    assert history[2]["eval_sets/_type"] == "table-file"
    table = json.loads((run_file.parent / "files" / history[2]["eval_sets/path"]).read_text())
    assert table["columns"] == ["set", "metric", "start", "final"]
    assert table["data"] == [["heldout", "accuracy", None, 0.5], ["heldout", "pass@4", None, 0.75]]
    summary: dict[str, Any] = {}
    for r in records:
        if r.HasField("summary"):
            summary |= items(r.summary.update)
    assert summary["eval_accuracy_final"] == 0.5
    assert kinds[-1] == "exit" and records[-1].exit.exit_code == 0
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 3  # the JSONL record stays


def test_runs_without_wandb_import_neither_wandb_nor_optuna(tmp_path):
    code = f"""
import sys
import relax_launch.cli
from relax_core.config.schema import RelaxConfig
from relax_core.telemetry.metrics import MetricsSink
cfg = RelaxConfig()
cfg.output_dir, cfg.logger.name, cfg.logger.plot = {str(tmp_path)!r}, "jsonl", False
sink = MetricsSink(cfg, {{}})
sink.log(1, {{"reward/mean": 1.0}})
sink.finish({{}})
print(sorted(m for m in ("wandb", "optuna") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
