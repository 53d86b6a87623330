"""Real Slurm, real runs: ``cluster=slurm`` submits a training run that is preempted, requeues and resumes;
``hydra/launcher=slurm`` runs a 2-point sweep as a job array, each point with its own Ray cluster, nested
under one MLflow parent run.

Needs a running Slurm with accounting (``eval "$(tests/slurm/start_cluster.sh)"``); skipped otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "resilience"))

from resilience_helpers import TINY_RUN, compose, read_metrics, wait_for_step  # noqa: E402
from test_slurm_infra import _assert_completed, _assert_nothing_left, requires_slurm  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# Ray inside the job advertises the job's CPUs; the roles of the tiny run need one CPU in all
SLURM_RUN = [o for o in TINY_RUN if not o.startswith("cluster.")]


def _release_requeued(job_id: str, timeout_s: float = 120.0) -> None:
    """Slurm holds a requeued batch job for ~2 min (BeginTime); an admin may start it early, as here.

    Not at once: slurmd refuses a launch whose credential is from the same second as the kill of the
    previous attempt ("already killed, do not launch batch job") and the job then FAILS. The hold exists
    to avoid that; a start a few seconds out keeps clear of it.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%T %r"], capture_output=True, text=True, timeout=15
        ).stdout.split()
        if out[:2] == ["PENDING", "BeginTime"]:
            subprocess.run(
                ["scontrol", "update", f"JobId={job_id}", "StartTime=now+3"], check=True, timeout=15
            )
            return
        if out and out[0] == "RUNNING" and _restarts(job_id) >= 1:
            return
        time.sleep(0.5)
    raise TimeoutError(f"job {job_id} was not requeued")


def _restarts(job_id: str) -> int:
    out = subprocess.run(
        ["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=15
    ).stdout
    field = next((f for f in out.split() if f.startswith("Restarts=")), "Restarts=0")
    return int(field.split("=")[1])


@requires_slurm
def test_cluster_slurm_run_is_preempted_requeues_and_resumes(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from relax_launch.cluster.slurm_submit import SlurmSubmitLauncher
    from relax_launch.experiment import run_experiment_on_ray

    run_dir = tmp_path / "run"
    steps = 40
    cfg = compose(
        [
            *SLURM_RUN,
            "cluster=slurm",
            "cluster.cpus_per_task=2",
            "cluster.time_min=30",
            "cluster.job_name=relax-requeue-test",
            # steps take 0.05 s on a fast host and the signal ~0.2 s to arrive (plus the 0.2 s poll): enough
            # steps after step 2 that it always lands mid-run
            f"trainer.total_steps={steps}",
            "trainer.save_every=100",  # no periodic checkpoint mid-run: the one resumed from is the signal's
        ],
        run_dir,
    )
    job = SlurmSubmitLauncher(OmegaConf.to_object(cfg).cluster).submit(cfg, run_experiment_on_ray)
    wait_for_step(run_dir, 2)
    # the time-limit signal submitit asks Slurm for (what `#SBATCH --signal=USR2@...` sends)
    subprocess.run(["scancel", "--signal=USR2", job.job_id], check=True, timeout=15)
    _release_requeued(job.job_id)
    summary = job.result()

    assert summary["status"] == "finished", summary
    assert _restarts(job.job_id) == 1
    resumed = Path(summary["resumed_from"])
    interrupted_at = int(resumed.name.split("_")[1])
    assert 2 <= interrupted_at < steps  # saved at the end of the step running when the signal came
    # every step exactly once across the two attempts, and the model was exported by the second one
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(0, steps + 1))
    assert (run_dir / "final_model" / "config.json").is_file()
    _assert_completed(job)
    _assert_nothing_left(job.job_id)


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
