"""``cluster=slurm cluster.nodes=2`` on a real Slurm of two nodes in network namespaces (``slurm_nodes.py``):
Ray spans both nodes, the run is preempted by its time-limit signal, requeues and resumes there.

The launcher runs outside the nodes, as on a login node; every Slurm command gets the cluster's own
``SLURM_CONF``. Skipped with the reason without root, namespaces or the Slurm packages.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(REPO / "tests" / "resilience"))

from resilience_helpers import TINY_RUN, read_metrics, wait_for_step  # noqa: E402
from slurm_nodes import SlurmNodes, skip_reason  # noqa: E402

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

NET = 83


@pytest.fixture(scope="module")
def slurm_nodes() -> Iterator[SlurmNodes]:
    reason = skip_reason()
    if reason:
        pytest.skip(f"no namespaced Slurm: {reason}")
    with SlurmNodes(2, cpus=2, net=NET) as cluster:
        yield cluster


ROLES = ("Actor", "Rollout", "Reference", "Critic", "Teacher")


def _role_processes(cluster: SlurmNodes, node: int) -> set[str]:
    """The roles whose Ray actor processes (titled ``ray::<Role>`` or ``ray::<Role>.<method>``) run in node
    ``node``'s network namespace; Ray's own agents, present on every node, do not count."""
    pids = subprocess.run(["ip", "netns", "pids", cluster._netns(node)], capture_output=True, text=True)
    roles = set()
    for pid in pids.stdout.split():
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        name = title.removeprefix("ray::").split(".")[0].split()[0] if title.startswith("ray::") else ""
        if name in ROLES:
            roles.add(name)
    return roles


def _job(cluster: SlurmNodes, job_id: str) -> dict[str, str]:
    out = cluster.slurm("scontrol", "show", "job", "-o", job_id).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def _release_requeued(cluster: SlurmNodes, job_id: str, timeout_s: float = 120.0) -> None:
    """Start the requeued job a few seconds out instead of after Slurm's ~2 min hold (see
    ``tests/slurm/test_slurm_runs.py``: a start in the second of the kill fails)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = _job(cluster, job_id)
        if job.get("JobState") == "PENDING" and job.get("Reason") == "BeginTime":
            cluster.slurm("scontrol", "update", f"JobId={job_id}", "StartTime=now+3")
            return
        if job.get("JobState") == "RUNNING" and int(job.get("Restarts", 0)) >= 1:
            return
        time.sleep(0.5)
    raise TimeoutError(f"job {job_id} was not requeued: {_job(cluster, job_id)}")


def _wait_job_end(cluster: SlurmNodes, job_id: str, timeout_s: float, during=None) -> dict[str, str]:
    """The job's record once it has ended (the launcher returns before Slurm has finished the job);
    ``during()`` is called every half second until then."""
    deadline = time.monotonic() + timeout_s
    job = _job(cluster, job_id)
    while job.get("JobState") in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED"):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"job {job_id} still {job['JobState']} after {timeout_s:g} s\n{cluster.logs()}"
            )
        if during is not None:
            during()
        time.sleep(0.5)
        job = _job(cluster, job_id)
    return job


def _job_processes(cluster: SlurmNodes, job_id: str) -> list[str]:
    """Processes of any node still carrying the job's id in their environment."""
    needle = f"SLURM_JOB_ID={job_id}\0".encode()
    left = []
    for node in range(2):
        pids = subprocess.run(["ip", "netns", "pids", cluster._netns(node)], capture_output=True, text=True)
        for pid in pids.stdout.split():
            try:
                if needle in Path(f"/proc/{pid}/environ").read_bytes():
                    left.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120])
            except OSError:
                continue
    return left


def _assert_nothing_left(cluster: SlurmNodes, job_id: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s  # the step's processes are reaped shortly after it ends
    while _job_processes(cluster, job_id) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _job_processes(cluster, job_id)
    assert not left, f"processes outlived Slurm job {job_id}: {left}"


def test_cluster_slurm_spans_two_nodes_is_preempted_requeues_and_resumes(
    slurm_nodes: SlurmNodes, tmp_path: Path
) -> None:
    cluster, run_dir, steps = slurm_nodes, tmp_path / "run", 12
    launch = [
        sys.executable, "-m", "relax_launch", f"hydra.run.dir={run_dir}",
        *[o for o in TINY_RUN if not o.startswith("cluster.")],
        "cluster=slurm", "cluster.nodes=2", "cluster.time_min=30", "cluster.job_name=relax-mn-requeue",
        # each Ray node advertises 1 CPU, two 1- and 0.5-CPU bundles (engine 0 with the Actor, engine 1):
        # no one node holds both, so the roles run on both nodes
        "cluster.cpus_per_task=1", "rollout.num_engines=2",
        f"trainer.total_steps={steps}", "trainer.save_every=100",  # the checkpoint resumed from is the signal's
    ]  # fmt: skip
    proc = subprocess.Popen(
        launch, cwd=tmp_path, env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_for_step(run_dir, 2, timeout_s=300)
        roles = {node: _role_processes(cluster, node) for node in range(2)}
        job_id = cluster.slurm("squeue", "-h", "-n", "relax-mn-requeue", "-o", "%i").stdout.strip()
        assert _job(cluster, job_id)["NodeList"] == f"rx{NET}n[0-1]"
        # the time-limit signal submitit asks Slurm for (what `#SBATCH --signal=USR2@...` sends)
        cluster.slurm("scancel", "--signal=USR2", job_id).check_returncode()
        _release_requeued(cluster, job_id)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]

    # Ray's roles on 10.83.0.1 and 10.83.0.2: the Actor on one node, a rollout engine on the other at least
    assert all(roles.values()) and {"Actor", "Rollout"} <= roles[0] | roles[1], roles
    job = _wait_job_end(cluster, job_id, 60)
    assert (job["JobState"], job["Restarts"]) == ("COMPLETED", "1"), job
    # every step exactly once across the two attempts, the second resumed from the signal's checkpoint
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished", summary
    assert 2 <= int(Path(summary["resumed_from"]).name.split("_")[1]) < steps
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(0, steps + 1))
    assert (run_dir / "final_model" / "config.json").is_file()
    _assert_nothing_left(cluster, job_id)


def test_sbatch_script_runs_ray_across_two_nodes(slurm_nodes: SlurmNodes, tmp_path: Path) -> None:
    """``sbatch --nodes=2 examples/slurm/relax.sbatch ...``: the script's Ray head on the first node, a worker
    started by ``srun`` on the other, the launcher attached to it."""
    cluster, run_dir = slurm_nodes, tmp_path / "run"
    sbatch = [
        "sbatch", "--parsable", "--nodes=2", "--cpus-per-task=1", f"--chdir={tmp_path}",
        f"--export=ALL,RELAX_PYTHON={sys.executable}", str(REPO / "examples" / "slurm" / "relax.sbatch"),
        f"hydra.run.dir={run_dir}", *[o for o in TINY_RUN if not o.startswith("cluster.")],
        "rollout.num_engines=2", "trainer.total_steps=2",
    ]  # fmt: skip
    submitted = cluster.slurm(*sbatch)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    roles: dict[int, set[str]] = {0: set(), 1: set()}

    def record_roles() -> None:
        for node in roles:
            roles[node] |= _role_processes(cluster, node)

    job = _wait_job_end(cluster, job_id, 300, during=record_roles)
    log = tmp_path / f"relax-{job_id}.out"
    assert job["JobState"] == "COMPLETED", log.read_text()[-3000:] if log.is_file() else job
    assert all(roles.values()) and {"Actor", "Rollout"} <= roles[0] | roles[1], roles
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2]
    _assert_nothing_left(cluster, job_id)
