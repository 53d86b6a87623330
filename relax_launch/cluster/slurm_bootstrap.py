"""Build a Ray cluster across a Slurm allocation, from inside the job.

Two layouts are supported, picked from the SLURM_* variables of the calling process:

* **one task for the whole job** (an sbatch script, or a submitit job on one node): this task starts the Ray
  head on its node and, when the job has more nodes, one Ray worker on each of them with a background
  ``srun --overlap --nodes=N-1 --ntasks-per-node=1``;
* **one task per node** (``srun --ntasks-per-node=1 ...`` or submitit ``nodes=N, tasks_per_node=1``): task 0
  starts the head, the first task on every other node joins it and serves until the head goes away.

Python use (e.g. the function a submitit job runs)::

    address = bootstrap_ray_in_allocation(num_cpus=None, num_gpus=None)
    if address is None:      # a worker task in the one-task-per-node layout: the cluster is finished
        return None
    try:
        ray.init(address=address)
        ...
    finally:
        stop_ray()

Command line (used by ``examples/slurm/relax.sbatch``)::

    python -m relax_launch.cluster.slurm_bootstrap run -- python -m relax_launch cluster=slurm_allocation
    python -m relax_launch.cluster.slurm_bootstrap worker --address HEAD:PORT   # what srun starts per node

All Ray processes are children of ``ray start --block`` run by this module, so Slurm's process tracking sees
them and they end with the job step; ``stop_ray`` ends them earlier.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 180.0
_PR_SET_PDEATHSIG = 1

# Processes started by this module in this process: `ray start --block` (head or worker) and the
# background `srun` whose tasks serve as workers on the other nodes.
_children: list[subprocess.Popen] = []
_worker_steps: list[subprocess.Popen] = []


@dataclass(frozen=True)
class SlurmAllocation:
    """What this process knows about its Slurm job and its place in it."""

    job_id: str
    hostnames: tuple[str, ...]  # every node of the job, node 0 first
    node_rank: int  # index of this node in the step (SLURM_NODEID)
    task_rank: int  # rank of this task in its step (SLURM_PROCID)
    local_rank: int  # rank of this task on its node (SLURM_LOCALID)
    step_tasks: int  # tasks in the current step (1 in a batch script)
    step_nodes: int  # nodes the current step spans
    cpus_on_node: int | None  # CPUs the job holds on this node
    gpus_on_node: int | None  # GPUs visible to this task, None when unknown
    mem_on_node_mb: int | None  # memory the job holds on this node, None when not limited

    @property
    def num_nodes(self) -> int:
        return len(self.hostnames)

    @property
    def is_head(self) -> bool:
        """True for the task that runs the Ray head (and the driver): task 0 of the step."""
        return self.task_rank == 0

    @property
    def one_task_per_node(self) -> bool:
        """True when every node of the job runs a task of this step (so no extra srun is needed)."""
        return self.step_tasks > 1 and self.step_nodes >= self.num_nodes

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SlurmAllocation:
        """Read the allocation from SLURM_* variables (submitit's JobEnvironment when running under it).

        Raises:
            RuntimeError: when not inside a Slurm job.
        """
        env = os.environ if env is None else env
        if "SLURM_JOB_ID" not in env:
            raise RuntimeError("not inside a Slurm job: SLURM_JOB_ID is unset")
        node_rank = _int(env.get("SLURM_NODEID"), 0)
        task_rank = _int(env.get("SLURM_PROCID"), 0)
        local_rank = _int(env.get("SLURM_LOCALID"), 0)
        step_tasks = _int(env.get("SLURM_STEP_NUM_TASKS"), 1)
        if env is os.environ:
            sub = _submitit_env()
            if sub is not None:  # its ranks are authoritative inside a submitit job
                node_rank, task_rank, local_rank = sub.node, sub.global_rank, sub.local_rank
                step_tasks = sub.num_tasks
        hostnames = tuple(expand_hostlist(env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", ""))))
        if not hostnames:
            hostnames = (socket.gethostname(),)
        return cls(
            job_id=env["SLURM_JOB_ID"],
            hostnames=hostnames,
            node_rank=node_rank,
            task_rank=task_rank,
            local_rank=local_rank,
            step_tasks=step_tasks,
            step_nodes=_int(env.get("SLURM_STEP_NUM_NODES"), 1),
            cpus_on_node=_first_int(env.get("SLURM_CPUS_ON_NODE")),
            gpus_on_node=_visible_gpus(env),
            mem_on_node_mb=_first_int(env.get("SLURM_MEM_PER_NODE")),
        )


def expand_hostlist(nodelist: str) -> list[str]:
    """Expand a Slurm hostlist such as ``gpu[01-03,07],login1`` into host names (via ``scontrol``)."""
    if not nodelist:
        return []
    if "[" not in nodelist:
        return [h for h in nodelist.split(",") if h]
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True, timeout=30
    )
    return out.stdout.split()


def resolve_head_ip(alloc: SlurmAllocation, head: str | None = None) -> str:
    """The IP address every node uses to reach the Ray head on host ``head`` (default: node 0).

    Order: ``RELAX_RAY_HEAD_IP`` (manual override), the node's ``NodeAddr`` in Slurm (the address Slurm
    itself uses, so it is routable inside the allocation), the head host name, then
    ``SLURM_LAUNCH_NODE_IPADDR`` (right only when srun was started on node 0, e.g. from the batch script).
    """
    if os.environ.get("RELAX_RAY_HEAD_IP"):
        return os.environ["RELAX_RAY_HEAD_IP"]
    head = head or alloc.hostnames[0]
    candidates: list[str] = []
    try:
        out = subprocess.run(
            ["scontrol", "show", "node", head, "-o"], capture_output=True, text=True, timeout=30
        ).stdout
        candidates += [f.split("=", 1)[1] for f in out.split() if f.startswith("NodeAddr=")]
    except (OSError, subprocess.SubprocessError):
        pass
    candidates.append(head)
    for name in candidates:
        try:
            return socket.gethostbyname(name)
        except OSError:
            continue
    if os.environ.get("SLURM_LAUNCH_NODE_IPADDR"):
        return os.environ["SLURM_LAUNCH_NODE_IPADDR"]
    raise RuntimeError(f"cannot resolve an address for the Ray head node {head!r}; set RELAX_RAY_HEAD_IP")


def default_ray_port(job_id: str) -> int:
    """A GCS port derived from the job id, so jobs sharing a node do not collide.

    Even ports in 20000-29998 (the next odd port is the Ray client server's): above Ray's default worker
    port range (10002-19999) and below the kernel's ephemeral range (32768+).
    """
    base = job_id.split("_")[0]
    return 20000 + 2 * (int(base) % 5000) if base.isdigit() else 6379


def bootstrap_ray_in_allocation(
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    port: int | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    extra_srun_args: Sequence[str] = (),
) -> str | None:
    """Start (or join) a Ray cluster spanning every node of the current Slurm job.

    Args:
        num_cpus: logical CPUs each Ray node advertises; default: the CPUs Slurm gave the job on that node
            (``SLURM_CPUS_ON_NODE``). It may exceed the cores: light actors request fractions of a CPU.
        num_gpus: GPUs per Ray node; default: the GPUs visible to the task (``CUDA_VISIBLE_DEVICES``, then
            ``SLURM_GPUS_ON_NODE``), otherwise Ray's own detection.
        port: GCS port of the head; default :func:`default_ray_port` of the job id.
        timeout_s: how long to wait for the head and for all nodes to register.
        extra_srun_args: extra arguments for the ``srun`` that starts workers (one-task layout only).

    Returns:
        ``"ip:port"`` of the head on the head task, once all nodes are alive; ``RAY_ADDRESS`` is set to it.
        ``None`` on the other tasks of a one-task-per-node step: they serve as Ray workers until the head
        stops, then return; the caller should simply return too.

    Raises:
        RuntimeError: not in a Slurm job, or a Ray process failed to start.
        TimeoutError: nodes did not register within ``timeout_s``.
    """
    # Ray 2.60: `ray start` turns token auth on whenever ~/.ray/auth_token exists (a local `ray.init()` writes
    # one), so whether a node needs a token would depend on its home dir. Pin it off unless the user chose.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    alloc = SlurmAllocation.from_env()
    port = port or default_ray_port(alloc.job_id)
    # One task per node: every task must agree on the head without talking, so it is node 0. One task in
    # all: the head is wherever this task runs (a batch script always runs on node 0, srun may not).
    head_host = alloc.hostnames[0]
    if not alloc.one_task_per_node and os.environ.get("SLURMD_NODENAME") in alloc.hostnames:
        head_host = os.environ["SLURMD_NODENAME"]
    head_ip = resolve_head_ip(alloc, head_host)
    address = f"{head_ip}:{port}"

    if not alloc.is_head:
        if alloc.one_task_per_node and alloc.local_rank == 0:
            serve_ray_worker(address, num_cpus=num_cpus, num_gpus=num_gpus, timeout_s=timeout_s)
        else:  # extra tasks on a node: nothing to run, wait so the step does not finish under the head
            _wait_until_gone(address, timeout_s)
        return None

    head_cmd = _ray_start_args(alloc, num_cpus, num_gpus) + [
        "--head",
        f"--port={port}",
        f"--ray-client-server-port={port + 1}",
        f"--node-ip-address={head_ip}",
        "--include-dashboard=false",
    ]
    log.info("starting Ray head at %s on %s (%d node(s))", address, head_host, alloc.num_nodes)
    head = _spawn(head_cmd, ray_node=True)
    try:
        wait_for_nodes(1, timeout_s, address=address, watch=head)
        if alloc.num_nodes > 1 and not alloc.one_task_per_node:
            others = [h for h in alloc.hostnames if h != head_host]
            _worker_steps.append(
                _spawn(_srun_workers_cmd(others, address, num_cpus, num_gpus, extra_srun_args))
            )
        wait_for_nodes(alloc.num_nodes, timeout_s, address=address, watch=head)
    except BaseException:
        stop_ray()
        raise
    os.environ["RAY_ADDRESS"] = address
    log.info("Ray cluster ready at %s with %d node(s)", address, alloc.num_nodes)
    return address


def serve_ray_worker(
    address: str,
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Join the head at ``address`` from this node and serve until the head goes away (then stop)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    _wait_until_reachable(address, timeout_s)
    alloc = SlurmAllocation.from_env()
    worker = _spawn(_ray_start_args(alloc, num_cpus, num_gpus) + [f"--address={address}"], ray_node=True)
    try:
        misses = 0
        while worker.poll() is None and misses < 3:  # 3 missed probes ~ 3 s after the head stopped
            misses = 0 if _reachable(address) else misses + 1
            time.sleep(1.0)
    finally:
        stop_ray()


def wait_for_nodes(
    expected: int,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    address: str | None = None,
    watch: subprocess.Popen | None = None,
) -> int:
    """Wait until the Ray cluster reports at least ``expected`` alive nodes; return the count seen.

    Uses the connected driver when ``ray.init`` was called, otherwise asks the GCS at ``address`` (default
    ``RAY_ADDRESS``) directly, so this process does not become a Ray driver. ``watch``: a process whose
    death aborts the wait (the local ``ray start``).

    Raises:
        TimeoutError: fewer nodes than expected after ``timeout_s``.
        RuntimeError: ``watch`` exited.
    """
    address = address or os.environ.get("RAY_ADDRESS")
    deadline = time.monotonic() + timeout_s
    alive = 0
    while True:
        if watch is not None and watch.poll() is not None:
            raise RuntimeError(f"`{' '.join(map(str, watch.args))}` exited with {watch.returncode}")
        alive = _alive_nodes(address)
        if alive >= expected:
            return alive
        if time.monotonic() > deadline:
            raise TimeoutError(f"{alive}/{expected} Ray nodes alive at {address} after {timeout_s:.0f}s")
        time.sleep(0.5)


def stop_ray(timeout_s: float = 15.0) -> None:
    """Disconnect the driver and stop every Ray process this module started here (head, worker, srun).

    Ray processes of other jobs on the same host are left alone (unlike ``ray stop``).
    """
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        sys.modules["ray"].shutdown()
    deadline = time.monotonic() + timeout_s
    nodes = [p for p in _children if p not in _worker_steps]
    for proc in nodes:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # `ray start --block` stops its node
    _reap(nodes, deadline)
    # Ray's dashboard and runtime-env agents outlive their node's `ray start` when the head is gone first: they
    # report the raylet's end to the dead GCS and hang there (seen for over 45 s on the other nodes of a job).
    # They share the node's process group, which ends with it.
    for proc in nodes:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    # Workers started by srun see the head go away and exit 0 within seconds, so their step ends COMPLETED;
    # SIGTERM to srun (the step is cancelled) only when they do not.
    _reap(_worker_steps, min(deadline, time.monotonic() + 10.0), signal.SIGTERM)
    _reap(_worker_steps, deadline)
    _children.clear()
    _worker_steps.clear()


def _reap(procs: Sequence[subprocess.Popen], deadline: float, escalate: int = signal.SIGKILL) -> None:
    """Wait for ``procs`` until ``deadline``; send ``escalate`` to those still running then."""
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.send_signal(escalate)
            if escalate == signal.SIGKILL:
                proc.wait()


atexit.register(stop_ray)


# --- helpers ----------------------------------------------------------------------------------------------


def _int(value: str | None, default: int) -> int:
    parsed = _first_int(value)
    return default if parsed is None else parsed


def _first_int(value: str | None) -> int | None:
    """First number of values like ``"4"`` or ``"4(x2),2"`` (Slurm's per-node lists)."""
    if not value:
        return None
    digits = ""
    for ch in value:
        if not ch.isdigit():
            break
        digits += ch
    return int(digits) if digits else None


def _visible_gpus(env: Mapping[str, str]) -> int | None:
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return 0 if cvd in ("", "NoDevFiles") else len([d for d in cvd.split(",") if d])
    return _first_int(env.get("SLURM_GPUS_ON_NODE"))


def _submitit_env():
    """submitit's JobEnvironment when this process is a submitit job, else None."""
    if "SUBMITIT_EXECUTOR" not in os.environ:
        return None
    try:
        import submitit

        return submitit.JobEnvironment()
    except Exception:  # not a submitit job after all
        return None


def _ray_executable() -> str:
    beside = Path(sys.executable).with_name("ray")  # the same environment as this interpreter
    return str(beside) if beside.exists() else (shutil.which("ray") or "ray")


def _ray_start_args(alloc: SlurmAllocation, num_cpus: int | None, num_gpus: int | None) -> list[str]:
    args = [_ray_executable(), "start", "--block", "--disable-usage-stats"]
    cpus = num_cpus if num_cpus is not None else alloc.cpus_on_node
    gpus = num_gpus if num_gpus is not None else alloc.gpus_on_node
    if cpus is not None:
        args.append(f"--num-cpus={max(1, cpus)}")  # Ray wants whole CPUs per node; fractions go to tasks
    if gpus is not None:
        args.append(f"--num-gpus={gpus}")
    if alloc.mem_on_node_mb:  # keep Ray inside the job's memory: 30% object store, the rest for tasks
        total = alloc.mem_on_node_mb * 1024 * 1024
        args += [f"--object-store-memory={int(total * 0.3)}", f"--memory={int(total * 0.6)}"]
    return args


def _srun_workers_cmd(
    others: Sequence[str],
    address: str,
    num_cpus: int | None,
    num_gpus: int | None,
    extra: Sequence[str],
) -> list[str]:
    n = len(others)
    cmd = [
        "srun",
        "--overlap",  # share the allocation with the running step instead of queueing behind it
        f"--nodes={n}",
        f"--ntasks={n}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(others)}",
        "--kill-on-bad-exit=0",
        "--job-name=ray-workers",  # the step's name in squeue/sacct
        *extra,
        sys.executable,
        "-m",
        "relax_launch.cluster.slurm_bootstrap",
        "worker",
        f"--address={address}",
    ]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    if num_gpus is not None:
        cmd.append(f"--num-gpus={num_gpus}")
    return cmd


def _die_with_parent() -> None:
    # Children get SIGTERM if this process dies without cleanup, so no Ray node outlives its job step.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
    # Slurm sends the time-limit/checkpoint signal (submitit: USR2, the sbatch example: USR1) to every process
    # of the step; it is meant for the driver, which then saves a checkpoint on this very cluster. Ray nodes
    # ignore it (the disposition is inherited by raylet and the workers) instead of dying of it.
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)


def _spawn(cmd: list[str], ray_node: bool = False) -> subprocess.Popen:
    """``cmd`` as a child that dies with this process; ``ray_node``: a ``ray start``, in a process group of its
    own so that :func:`stop_ray` can end every process of the node."""
    log.debug("spawn: %s", " ".join(cmd))
    env = dict(os.environ)
    # On SIGTERM a Ray node first asks the GCS to drain it (up to 30 s, longer still once the head is gone);
    # a job's cluster ends as a whole, so tear down at once.
    env.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        env=env,
        preexec_fn=_die_with_parent,
        process_group=0 if ray_node else None,
    )
    _children.append(proc)
    return proc


def _alive_nodes(address: str | None) -> int:
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return sum(1 for n in ray.nodes() if n.get("Alive"))
    if not address:
        raise RuntimeError("no Ray address: pass address= or set RAY_ADDRESS")
    if not _reachable(address):
        return 0
    from ray._raylet import GcsClient  # private but stable; avoids becoming a driver just to count nodes

    try:
        infos = GcsClient(address=address).get_all_node_info(timeout=5)
    except Exception as exc:  # GCS up but not serving yet
        log.debug("GCS query failed: %s", exc)
        return 0
    return sum(1 for info in infos.values() if info.state == 0)  # GcsNodeState.ALIVE


def _reachable(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except OSError:
        return False


def _wait_until_reachable(address: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not _reachable(address):
        if time.monotonic() > deadline:
            raise TimeoutError(f"Ray head {address} not reachable after {timeout_s:.0f}s")
        time.sleep(0.5)


def _wait_until_gone(address: str, timeout_s: float) -> None:
    try:
        _wait_until_reachable(address, timeout_s)
    except TimeoutError:
        return
    while _reachable(address):
        time.sleep(1.0)


# --- command line -----------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``run -- CMD...``: cluster up, run CMD on the head with RAY_ADDRESS set, cluster down.
    ``worker --address A``: join A from this node until the head stops (what ``srun`` runs per node)."""
    parser = argparse.ArgumentParser(prog="python -m relax_launch.cluster.slurm_bootstrap")
    sub = parser.add_subparsers(dest="action", required=True)
    for name in ("run", "worker"):
        p = sub.add_parser(name)
        p.add_argument("--num-cpus", type=int, default=None)
        p.add_argument("--num-gpus", type=int, default=None)
        p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    sub.choices["run"].add_argument("--port", type=int, default=None)
    sub.choices["run"].add_argument("command", nargs=argparse.REMAINDER)
    sub.choices["worker"].add_argument("--address", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[slurm_bootstrap] %(message)s")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    if args.action == "worker":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # srun cancelling the step: run stop_ray
        serve_ray_worker(args.address, num_cpus=args.num_cpus, num_gpus=args.num_gpus, timeout_s=args.timeout)
        return 0

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("run needs a command after --")
    try:
        address = bootstrap_ray_in_allocation(args.num_cpus, args.num_gpus, args.port, timeout_s=args.timeout)
    except (RuntimeError, TimeoutError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if address is None:
        return 0
    # Forward scancel/timeout signals to the command, then tear the cluster down.
    proc = subprocess.Popen(command)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, lambda s, _f: proc.send_signal(s))
    try:
        return proc.wait()
    finally:
        stop_ray()


if __name__ == "__main__":
    sys.exit(main())
