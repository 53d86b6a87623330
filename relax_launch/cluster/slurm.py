"""``cluster=slurm``: run a whole experiment as a Slurm job through submitit.

Outside a Slurm job, :func:`submit_run` submits one job of ``cluster.nodes`` nodes (one task per node) and,
with ``cluster.wait``, waits for its summary. Inside the job every task calls :class:`SlurmRun`: node 0
starts the Ray head, the other nodes join it (``slurm_bootstrap``), the driver on node 0 waits until all
nodes are alive, runs the experiment on that cluster and stops it at the end.

Already inside an allocation (a Hydra sweep point started by ``hydra/launcher=slurm``, ``salloc``), the
same bootstrap runs in place: no second job is submitted.

Preemption and time limits: Slurm sends the submitit checkpoint signal ``cluster.signal_delay_s`` seconds
before the end (or on preemption). :meth:`SlurmRun.checkpoint` asks the step loop to stop at the end of the
current step; the loop saves a checkpoint, the job requeues itself with ``trainer.resume=auto`` and the
requeued job continues from that checkpoint (at most ``cluster.max_requeues`` times).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from relax_core.errors import RelaxUserError

log = logging.getLogger("relax")

# how long the checkpoint signal handler waits for the current step to finish and be saved
PREEMPT_SAVE_TIMEOUT_S = 90.0


def inside_slurm_job() -> bool:
    return "SLURM_JOB_ID" in os.environ


def executor_parameters(cluster, output_dir: str) -> dict[str, Any]:
    """submitit ``update_parameters`` kwargs from ``cluster.*`` (one task per node: Ray needs one node each)."""
    params: dict[str, Any] = {
        "nodes": cluster.nodes,
        "tasks_per_node": 1,
        "cpus_per_task": cluster.cpus_per_task,
        "timeout_min": cluster.time_min,
        "slurm_job_name": cluster.job_name,
        "slurm_signal_delay_s": cluster.signal_delay_s,
        "slurm_setup": list(cluster.setup) + [_pythonpath_line()],
    }
    if cluster.gpus_per_node:
        params["gpus_per_node"] = cluster.gpus_per_node
    if cluster.mem_gb is not None:
        params["mem_gb"] = cluster.mem_gb
    if cluster.partition:
        params["slurm_partition"] = cluster.partition
    if cluster.account:
        params["slurm_account"] = cluster.account
    if cluster.qos:
        params["slurm_qos"] = cluster.qos
    if cluster.additional_sbatch:
        params["slurm_additional_parameters"] = dict(cluster.additional_sbatch)
    return params


def _pythonpath_line() -> str:
    """The job imports the same Relax as the submitter, installed or not."""
    root = Path(__file__).resolve().parents[2]
    return f"export PYTHONPATH={root}${{PYTHONPATH:+:$PYTHONPATH}}"


def submit_run(cfg: DictConfig) -> dict[str, Any] | None:
    """Submit ``cfg`` as one Slurm job; return the run's summary (None when ``cluster.wait`` is false)."""
    job = submit(cfg)
    if not cfg.cluster.wait:
        return None
    results = job.results()
    return next((r for r in results if r is not None), None)


def submit(cfg: DictConfig):
    """Submit ``cfg`` as one Slurm job of ``cluster.nodes`` nodes and return the ``submitit.Job``."""
    import shutil

    import submitit

    if shutil.which("sbatch") is None:
        raise RelaxUserError("cluster=slurm: sbatch is not on PATH (is this a Slurm login node?)")
    cluster = cfg.cluster
    folder = Path(cfg.output_dir) / cluster.log_dir
    executor = submitit.AutoExecutor(
        folder=folder / "%j", cluster="slurm", slurm_max_num_timeout=cluster.max_requeues
    )
    try:
        executor.update_parameters(**executor_parameters(cluster, cfg.output_dir))
    except (ValueError, TypeError, NameError) as err:
        raise RelaxUserError(f"cluster=slurm: {err}") from None
    container = OmegaConf.to_container(cfg, resolve=True)
    job = executor.submit(SlurmRun(), container)
    log.info("submitted Slurm job %s (%d node(s)); logs: %s", job.job_id, cluster.nodes, folder / job.job_id)
    print(f"relax: Slurm job {job.job_id} submitted; logs in {folder / job.job_id}", file=sys.stderr)
    return job


class SlurmRun:
    """What every task of the job runs (picklable; submitit calls it and, on the signal, ``checkpoint``)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def __call__(self, container: dict[str, Any]) -> dict[str, Any] | None:
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
        cfg = _to_config(container)
        outcome: dict[str, Any] = {}

        def target() -> None:
            try:
                outcome["summary"] = run_in_allocation(cfg)
            except BaseException as err:  # re-raised in the main thread
                outcome["error"] = err

        # The run goes on a thread so that the main thread stays free for submitit's signal handler, which
        # then waits for the step in flight to finish and be saved.
        self._thread = threading.Thread(target=target, name="relax-run")
        self._thread.start()
        while self._thread.is_alive():
            self._thread.join(timeout=0.5)
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("summary")

    def checkpoint(self, container: dict[str, Any]):
        """Stop at the end of the current step (the loop saves a checkpoint), then requeue with resume=auto."""
        import submitit

        from relax_core.checkpoint import STOP_REQUEST

        log.warning("checkpoint signal: saving at the end of the current step, then requeueing")
        STOP_REQUEST.set()
        if self._thread is not None:
            self._thread.join(timeout=PREEMPT_SAVE_TIMEOUT_S)
        container = dict(container)
        container["trainer"] = dict(container["trainer"], resume="auto")
        return submitit.helpers.DelayedSubmission(SlurmRun(), container)


def _to_config(container: dict[str, Any]) -> DictConfig:
    from relax_core.config import RelaxConfig

    return OmegaConf.merge(OmegaConf.structured(RelaxConfig), container)


def run_in_allocation(cfg: DictConfig) -> dict[str, Any] | None:
    """Inside a Slurm job: Ray across the allocation, the experiment on node 0, Ray down; None elsewhere."""
    from relax_launch.cluster.slurm_bootstrap import bootstrap_ray_in_allocation, stop_ray
    from relax_launch.run import run_experiment

    started = time.monotonic()
    address = bootstrap_ray_in_allocation(port=None if cfg.cluster.ray_port == 6379 else cfg.cluster.ray_port)
    if address is None:  # a worker node: it served until the head stopped
        return None
    log.info("Ray cluster over the allocation ready in %.1fs at %s", time.monotonic() - started, address)
    try:
        cfg.cluster.address = address
        return run_experiment(cfg, in_allocation=True)
    finally:
        stop_ray()
