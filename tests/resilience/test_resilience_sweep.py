"""A local Hydra multirun: points run one after another, MLflow shows one parent run with a child per point."""

from __future__ import annotations

from pathlib import Path

import launching
import pytest
from resilience_helpers import TINY_RUN, read_metrics

pytestmark = pytest.mark.slow


def test_local_sweep_nests_point_runs_under_one_parent(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    launching.launch(
        None,
        "-m",
        f"hydra.sweep.dir={sweep_dir}",
        *[o for o in TINY_RUN if not o.startswith("logger=")],
        "logger=mlflow",
        "trainer.sft_warmup_steps=0",
        "trainer.total_steps=1",
        "seed=1,2",
        env=launching.RAY_NO_AUTH,
        cwd=tmp_path,
        timeout=900,
    )

    from mlflow.tracking import MlflowClient

    from relax_launch.sweep import sweep_tracking_uri

    for point in ("0", "1"):
        assert [r["step"] for r in read_metrics(sweep_dir / point)] == [0, 1]
        assert not (sweep_dir / point / "mlflow.db").exists()  # one shared store for the sweep
    client = MlflowClient(tracking_uri=sweep_tracking_uri(sweep_dir))
    parent_id = (sweep_dir / "mlflow_parent_run_id").read_text().strip()
    runs = client.search_runs([client.get_experiment_by_name("relax").experiment_id])
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent_id]
    assert len(runs) == 3
    assert sorted(r.data.params["seed"] for r in children) == ["1", "2"]
    assert client.get_run(parent_id).info.status == "FINISHED"
    assert all(r.info.status == "FINISHED" and "reward/mean" in r.data.metrics for r in children)
    assert all(r.data.tags["mlflow.source.name"].endswith("relax_launch/__main__.py") for r in runs), runs
