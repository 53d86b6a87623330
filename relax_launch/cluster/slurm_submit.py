"""``cluster=slurm``: run a whole experiment as a Slurm job through submitit.

Outside a Slurm job, :meth:`SlurmSubmitLauncher.submit` submits one job of ``cluster.nodes`` nodes (one task
per node) and, with ``cluster.wait``, waits for its summary. Inside the job every task calls
:class:`SlurmRun`, which runs the experiment function it was given over the allocation
(:func:`relax_launch.cluster.slurm_allocation.run_over_allocation`: node 0 starts the Ray head, the other
nodes join it, the experiment runs on node 0, Ray stops at the end).

Already inside an allocation (a Hydra sweep point started by ``hydra/launcher=slurm``, ``salloc``), the
same function runs in place: no second job is submitted.

Preemption and time limits: Slurm sends the submitit checkpoint signal ``cluster.signal_delay_s`` seconds
before the end (or on preemption). :meth:`SlurmRun.checkpoint` asks the step loop to stop at the end of the
current step; the loop saves a checkpoint, the job requeues itself with ``trainer.resume=auto`` and the
requeued job continues from that checkpoint (at most ``cluster.max_requeues`` times).
"""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from relax_core.config.schema import RelaxConfig, SlurmClusterConfig
from relax_core.errors import RelaxUserError
from relax_launch.cluster.base import ClusterLauncher
from relax_launch.cluster.slurm_allocation import inside_slurm_job, run_over_allocation
from relax_launch.experiment import Experiment, Summary, report

log = logging.getLogger("relax")

# how long the checkpoint signal handler waits for the current step to finish and be saved
PREEMPT_SAVE_TIMEOUT_S = 90.0


def executor_parameters(cluster: SlurmClusterConfig) -> dict[str, Any]:
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


class SlurmSubmitLauncher(ClusterLauncher):
    schema = SlurmClusterConfig
    cluster: SlurmClusterConfig

    def launch(self, cfg: DictConfig, experiment: Experiment) -> Summary | None:
        """Submit the run as a job and return its summary (None when ``cluster.wait`` is false); inside an
        allocation already, run it over that allocation."""
        if inside_slurm_job():
            return run_over_allocation(cfg, experiment, self.cluster.ray_port)
        job = self.submit(cfg, experiment)
        if not self.cluster.wait:
            return None
        return next((r for r in job.results() if r is not None), None)

    def submit(self, cfg: DictConfig, experiment: Experiment):
        """Submit ``cfg`` as one Slurm job of ``cluster.nodes`` nodes and return the ``submitit.Job``."""
        import shutil

        import submitit

        if shutil.which("sbatch") is None:
            raise RelaxUserError("cluster=slurm: sbatch is not on PATH (is this a Slurm login node?)")
        cluster = self.cluster
        folder = Path(cfg.output_dir) / cluster.log_dir
        executor = submitit.AutoExecutor(
            folder=folder / "%j", cluster="slurm", slurm_max_num_timeout=cluster.max_requeues
        )
        try:
            executor.update_parameters(**executor_parameters(cluster))
        except (ValueError, TypeError, NameError) as err:
            raise RelaxUserError(f"cluster=slurm: {err}") from None
        container = OmegaConf.to_container(cfg, resolve=True)
        job = executor.submit(SlurmRun(experiment), container)
        log.info(
            "submitted Slurm job %s (%d node(s)); logs: %s", job.job_id, cluster.nodes, folder / job.job_id
        )
        print(f"relax: Slurm job {job.job_id} submitted; logs in {folder / job.job_id}", file=sys.stderr)
        return job


class SlurmRun:
    """What every task of the job runs (picklable; submitit calls it and, on the signal, ``checkpoint``)."""

    def __init__(self, experiment: Experiment) -> None:
        self.experiment = experiment
        self._thread: threading.Thread | None = None

    def __call__(self, container: dict[str, Any]) -> dict[str, Any] | None:
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
        cfg = _to_config(container)
        outcome: dict[str, Any] = {}

        def target() -> None:
            try:
                outcome["summary"] = run_over_allocation(cfg, self.experiment, cfg.cluster.ray_port)
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
        report(outcome.get("summary"))  # into the job's log
        return outcome.get("summary")

    def checkpoint(self, container: dict[str, Any]):
        """Stop at the end of the current step (the loop saves a checkpoint), then requeue with resume=auto."""
        import submitit

        from relax_core.resilience.checkpoint import STOP_REQUEST

        log.warning("checkpoint signal: saving at the end of the current step, then requeueing")
        STOP_REQUEST.set()
        if self._thread is not None:
            self._thread.join(timeout=PREEMPT_SAVE_TIMEOUT_S)
        container = dict(container)
        container["trainer"] = dict(container["trainer"], resume="auto")
        return submitit.helpers.DelayedSubmission(SlurmRun(self.experiment), container)


def _to_config(container: dict[str, Any]) -> DictConfig:
    return OmegaConf.merge(OmegaConf.structured(RelaxConfig(cluster=SlurmClusterConfig())), container)
