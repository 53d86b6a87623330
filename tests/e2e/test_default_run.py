"""The default experiment exactly as a user runs it: ``python -m relax_launch`` with no overrides.

It must learn (reward and held-out accuracy go up) and leave every promised artefact in the run dir.
"""

from __future__ import annotations

import json
from pathlib import Path

import launching
import pytest
from mlflow import MlflowClient
from omegaconf import OmegaConf
from PIL import Image

PHASES = ("time/rollout_s", "time/train_s", "time/weight_sync_s")
STEP_KEYS = {"step", "reward/mean", "reward/std", "loss", "kl", "entropy", "tokens_per_s", "step_time_s"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("default_run") / "run"
    result = launching.launch(out, timeout=3600, check=False)
    (out.parent / "stdout.log").write_text(result.stdout)
    (out.parent / "stderr.log").write_text(result.stderr)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "Traceback" not in result.stdout + result.stderr
    return out


@pytest.mark.slow
def test_default_run_learns(run_dir: Path) -> None:
    summary = json.loads((run_dir / "summary.json").read_text())
    numbers = json.dumps(summary, indent=1)
    assert summary["status"] == "finished"
    assert summary["reward_last_10pct"] - summary["reward_first_10pct"] >= 0.3, numbers
    assert summary["eval_accuracy_final"] > summary["eval_accuracy_untrained"], numbers
    assert summary["eval_accuracy_final"] > summary["eval_accuracy_start"], numbers


@pytest.mark.slow
def test_default_run_artefacts(run_dir: Path) -> None:
    config_text = (run_dir / "config.yaml").read_text()
    assert "${" not in config_text  # resolved before it was written
    config = OmegaConf.create(config_text)
    total = config.trainer.total_steps
    assert config.algorithm.name == "grpo" and config.model.name == "tiny_qwen3"

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["step"] >= 1]
    assert [r["step"] for r in rl] == list(range(1, total + 1))  # one object per RL step
    for r in rl:
        assert STEP_KEYS <= set(r), STEP_KEYS - set(r)
        assert all(p in r for p in PHASES), [p for p in PHASES if p not in r]
        assert 0.0 <= r["reward/mean"] <= 1.0 and r["tokens_per_s"] > 0 and r["step_time_s"] > 0
    assert any("eval/accuracy" in r for r in rl)

    png = run_dir / "reward_curve.png"
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size[0] > 200
        image.verify()

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(config.logger.experiment_name)
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["algorithm.name"] == "grpo"
    assert params["trainer.total_steps"] == str(total)
    assert params["rollout.batch_size"] == str(config.rollout.batch_size)
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert sorted(m.step for m in history) == list(range(1, total + 1))
    assert len(client.get_metric_history(run.info.run_id, "time/rollout_s")) == total
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"reward_curve.png", "config.yaml"} <= artifacts

    if config.trainer.export_final_model:
        assert (run_dir / "final_model" / "config.json").is_file()
