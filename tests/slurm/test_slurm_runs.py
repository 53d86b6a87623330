"""Real Slurm, real runs: ``hydra/launcher=slurm`` runs a 2-point sweep as a job array, each point with its own
Ray cluster, nested under one MLflow parent run. (``cluster=slurm`` preempted, requeued and resumed runs across
two nodes in ``tests/multinode/test_multinode_slurm.py``.)

Needs a running Slurm with accounting (``eval "$(tests/slurm/start_cluster.sh)"``); skipped otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "resilience"))

from resilience_helpers import TINY_RUN, read_metrics  # noqa: E402
from test_slurm_infra import requires_slurm  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# Ray inside the job advertises the job's CPUs; the roles of the tiny run need one CPU in all
SLURM_RUN = [o for o in TINY_RUN if not o.startswith("cluster.")]


@requires_slurm
def test_sweep_runs_as_a_slurm_job_array_with_one_mlflow_parent(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    cmd = [
        sys.executable,
        "-m",
        "relax_launch",
        "-m",
        "hydra/launcher=slurm",
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.timeout_min=20",
        f"hydra.sweep.dir={sweep_dir}",
        "cluster=slurm",
        *[o for o in SLURM_RUN if not o.startswith("logger=")],
        "logger=mlflow",
        "trainer.total_steps=2",
        "seed=1,2",
    ]
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]

    for point in ("0", "1"):
        assert [r["step"] for r in read_metrics(sweep_dir / point)] == [0, 1, 2]
    tasks = {p.name for p in (sweep_dir / ".submitit").iterdir() if p.name[0].isdigit() and "_" in p.name}
    assert len(tasks) == 2 and len({t.split("_")[0] for t in tasks}) == 1  # one array, two tasks

    from mlflow.tracking import MlflowClient

    from relax_launch.sweep import sweep_tracking_uri

    client = MlflowClient(tracking_uri=sweep_tracking_uri(sweep_dir))
    parent_id = (sweep_dir / "mlflow_parent_run_id").read_text().strip()
    experiment = client.get_experiment_by_name("relax")
    runs = client.search_runs([experiment.experiment_id])
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent_id]
    assert client.get_run(parent_id).info.status == "FINISHED"
    assert sorted(r.data.params["seed"] for r in children) == ["1", "2"]
    assert all(r.info.status == "FINISHED" for r in children)
    assert all("reward/mean" in r.data.metrics for r in children)
