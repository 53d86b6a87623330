"""Real Slurm: a submitit job builds a Ray cluster in its allocation and runs Ray work there.

Needs a running Slurm with accounting, e.g. ``eval "$(tests/slurm/start_cluster.sh)"``; skipped otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]


def _slurm_problem() -> str | None:
    """Why Slurm cannot be used here, or None when it can."""
    if shutil.which("sinfo") is None:
        return "sinfo not found (start one with tests/slurm/start_cluster.sh)"
    conf = os.environ.get("SLURM_CONF")
    if not conf:
        return 'SLURM_CONF is unset (run: eval "$(tests/slurm/start_cluster.sh)")'
    if not Path(conf).is_file():
        return f"SLURM_CONF={conf} does not exist"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return "sinfo timed out: slurmctld unreachable"
    if out.returncode != 0:
        return f"sinfo failed: {out.stderr.strip()[:200]}"
    if not any(s.startswith(("idle", "mixed")) for s in out.stdout.split()):
        return f"no idle Slurm node (states: {out.stdout.split()})"
    return None


_problem = _slurm_problem()
requires_slurm = pytest.mark.skipif(_problem is not None, reason=f"no usable Slurm: {_problem}")


def _idle_nodes() -> int:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=15)
    return sum(1 for s in out.stdout.split() if s.startswith("idle"))


def _ray_job(tag: str) -> dict | None:
    """Runs inside the Slurm job: Ray across the allocation, then a few tiny remote tasks."""
    import ray

    from relax_launch.cluster.slurm_bootstrap import bootstrap_ray_in_allocation, stop_ray

    address = bootstrap_ray_in_allocation()
    if address is None:  # worker task (one task per node): the cluster has been stopped
        return None
    try:
        ray.init(address=address, logging_level="WARNING")

        @ray.remote(num_cpus=0.25)  # fractional: the node may have a single CPU
        def square(x: int) -> tuple[int, str | None]:
            return x * x, os.environ.get("SLURM_JOB_ID")

        results = ray.get([square.remote(i) for i in range(4)])
        return {
            "tag": tag,
            "squares": [r[0] for r in results],
            "task_job_ids": sorted({r[1] for r in results}),
            "job_id": os.environ["SLURM_JOB_ID"],
            "nodes": sum(1 for n in ray.nodes() if n["Alive"]),
        }
    finally:
        stop_ray()


def _executor(tmp_path: Path, **params):
    import cloudpickle
    import submitit

    # The job imports this test module by name otherwise, which only pytest's sys.path can resolve.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    executor.update_parameters(
        timeout_min=5,
        slurm_job_name="relax-slurm-infra",
        # The job must import relax_launch from this checkout whether or not it is pip-installed.
        slurm_setup=[f"export PYTHONPATH={REPO}${{PYTHONPATH:+:$PYTHONPATH}}"],
        **params,
    )
    return executor


def _assert_completed(job, timeout_s: float = 120.0) -> None:
    """sacct lags the result file (the job's Python still exits, slurmdbd records the end; over 20 s once on
    a loaded machine): poll until the job leaves RUNNING/COMPLETING, then expect COMPLETED."""
    deadline = time.monotonic() + timeout_s
    state = job.get_info(mode="force").get("State", "UNKNOWN")
    while state in ("UNKNOWN", "PENDING", "RUNNING", "COMPLETING") and time.monotonic() < deadline:
        time.sleep(0.5)
        state = job.get_info(mode="force").get("State", "UNKNOWN")
    if state != "COMPLETED":  # say why: what slurmctld thinks of the job and which of its processes remain
        show = subprocess.run(["scontrol", "show", "job", job.job_id], capture_output=True, text=True)
        left = {pid: _cmdline(pid) for pid in _job_processes(job.job_id)}
        raise AssertionError(f"job {job.job_id} is {state}, not COMPLETED\n{show.stdout}{show.stderr}{left}")


def _job_processes(job_id: str) -> list[int]:
    """Processes still carrying the job's id in their environment (Ray leaking out of the job)."""
    needle = f"SLURM_JOB_ID={job_id}\0".encode()
    pids = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if needle in env.read_bytes():
                pids.append(int(env.parent.name))
        except OSError:
            continue
    return pids


def _assert_nothing_left(job_id: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s  # the step's processes are reaped shortly after it ends
    while _job_processes(job_id) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = {pid: _cmdline(pid) for pid in _job_processes(job_id)}
    assert not left, f"processes outlived Slurm job {job_id}: {left}"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return "?"


@requires_slurm
def test_submitit_job_bootstraps_ray_and_runs_a_task(tmp_path: Path) -> None:
    cpus = min(2, os.cpu_count() or 1)
    executor = _executor(tmp_path, nodes=1, tasks_per_node=1, cpus_per_task=cpus)
    job = executor.submit(_ray_job, "one-node")
    result = job.result()

    assert result["squares"] == [0, 1, 4, 9]
    assert result["task_job_ids"] == [job.job_id]  # the Ray task ran on the node started inside the job
    assert result["nodes"] == 1
    _assert_completed(job)

    _assert_nothing_left(job.job_id)


@requires_slurm
@pytest.mark.skipif(_problem is None and _idle_nodes() < 2, reason="needs >= 2 idle Slurm nodes")
def test_submitit_job_spanning_two_nodes_builds_one_ray_cluster(tmp_path: Path) -> None:
    # One task per node: task 0 runs the head and the driver, task 1 joins and serves until the head stops.
    executor = _executor(tmp_path, nodes=2, tasks_per_node=1, cpus_per_task=1)
    job = executor.submit(_ray_job, "two-nodes")
    head, worker = job.results()

    assert head["squares"] == [0, 1, 4, 9]
    assert head["nodes"] == 2
    assert worker is None
    _assert_completed(job)
    _assert_nothing_left(job.job_id)
