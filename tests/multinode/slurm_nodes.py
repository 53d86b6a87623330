"""A Slurm cluster over the namespaces of :class:`NetnsCluster`: one ``slurmd`` per node, no Ray.

Node ``i`` is the namespace of ``NetnsCluster`` node ``i`` (address ``10.<net>.0.<i+1>``, own loopback,
``/dev/shm`` and node-local folder) running ``slurmd -N <name>``; Ray is what the jobs start. ``slurmctld``
runs outside the namespaces on the bridge's own address ``10.<net>.0.254`` (so the test process and every
node reach it), on port ``6900+net`` with its own state, logs and ``SLURM_CONF`` under :attr:`dir`: it never
meets the one-node Slurm of ``tests/slurm/start_cluster.sh`` (port 6817). No accounting: job states come from
``scontrol`` (jobs stay listed ``MinJobAge`` seconds after they end).

Whatever runs Slurm commands against it needs ``SLURM_CONF`` (it is in :attr:`env`, the environment of the
nodes' processes). Needs root, the Debian Slurm and munge packages (``tests/slurm/start_cluster.sh``
installs them) and a munge key.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from netns_cluster import NetnsCluster, _sh
from netns_cluster import skip_reason as netns_skip_reason

_MUNGED = "/usr/sbin/munged"
# the daemons live in sbin, which a root shell's PATH may lack
_PATH = "/usr/local/sbin:/usr/sbin:/sbin:/usr/local/bin:/usr/bin:/bin"


def skip_reason() -> str | None:
    """Why a namespaced Slurm cannot run here, or None when it can."""
    missing = [d for d in ("slurmctld", "slurmd", "sbatch", "munge") if shutil.which(d, path=_PATH) is None]
    if missing:
        return f"missing {', '.join(missing)} (tests/slurm/start_cluster.sh installs them)"
    if not Path("/etc/munge/munge.key").is_file():
        return "no /etc/munge/munge.key (tests/slurm/start_cluster.sh makes one)"
    return netns_skip_reason()


class SlurmNodes(NetnsCluster):
    """``SlurmNodes(2, cpus=2, net=83)``: two Slurm nodes of 2 CPUs each, in partition ``debug``.

    A context manager like :class:`NetnsCluster`; ``run``/``popen``/``kill_node`` work the same way.
    """

    def __init__(self, nodes: int, *, cpus: int = 2, mem_mb: int = 2048, net: int = 77) -> None:
        super().__init__([cpus] * nodes, net=net)
        self.mem_mb = mem_mb
        self.ctld_ip = f"10.{net}.0.254"
        self.ctld_port = 6900 + net
        self.dir = Path(tempfile.mkdtemp(prefix=f"relax-slurm-{self.tag}-"))
        self.conf = self.dir / "slurm.conf"
        self.env["SLURM_CONF"] = str(self.conf)
        self.env["PATH"] = f"{self.env.get('PATH', '')}:{_PATH}"
        self._slurmds: dict[int, subprocess.Popen] = {}
        self._ctld: subprocess.Popen | None = None
        self._munged: subprocess.Popen | None = None

    def node_name(self, node: int) -> str:
        return f"rx{self.net}n{node}"

    # -- life cycle ----------------------------------------------------------------------------------------
    def start(self) -> None:
        self._started = True
        for sub in ("state", "spool", "log", "run"):
            (self.dir / sub).mkdir()
        self.conf.write_text(self._config())
        self._ensure_munge()
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        _sh("ip", "addr", "add", f"{self.ctld_ip}/24", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        log = open(self.dir / "log" / "slurmctld.out", "ab")  # noqa: SIM115 - written for slurmctld's life
        self._ctld = subprocess.Popen(
            ["slurmctld", "-D", "-f", str(self.conf)], env=self.env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            self._wait(lambda: "UP" in self.slurm("scontrol", "ping").stdout, 30, "slurmctld")
            for node in range(len(self._cpus)):
                self.start_node(node)
        except BaseException:  # __exit__ does not run when __enter__ fails
            self.stop()
            raise

    def start_node(self, node: int, timeout_s: float = 60.0) -> None:
        """Node ``node`` up (again, after :meth:`kill_node`): namespace, anchor, slurmd; waits until idle."""
        self._start_namespace(node)
        name = self.node_name(node)
        (self.dir / "spool" / name).mkdir(exist_ok=True)
        # `ip netns exec` mounts a fresh /sys without the cgroup tree, and slurmd will not start without one
        # (proctrack/linuxproc and task/none put nothing in it): a v1 root with the systemd hierarchy it checks
        mount = (
            "mountpoint -q /sys/fs/cgroup || { mount -t tmpfs -o size=1m cgroup /sys/fs/cgroup && "
            "mkdir /sys/fs/cgroup/systemd && mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd; }"
        )
        self.run(node, ["sh", "-c", mount], check=True)
        log = open(self.dir / "log" / f"slurmd-{name}.out", "ab")  # noqa: SIM115
        self._slurmds[node] = self.popen(
            node, ["slurmd", "-D", "-f", str(self.conf), "-N", name], stdout=log, stderr=subprocess.STDOUT
        )

        def idle() -> bool:
            if self._slurmds[node].poll() is not None:
                raise RuntimeError(f"slurmd {name} exited\n{self.logs()}")
            state = self.slurm("sinfo", "-h", "-n", name, "-o", "%T").stdout.strip()
            if state.startswith("down"):  # back after kill_node
                self.slurm("scontrol", "update", f"nodename={name}", "state=resume")
            return state == "idle"

        self._wait(idle, timeout_s, f"Slurm node {name} idle")

    def kill_node(self, node: int) -> None:
        super().kill_node(node)
        proc = self._slurmds.pop(node, None)
        if proc is not None:
            proc.wait(timeout=30)

    def stop(self) -> None:
        if not self._started:
            return
        super().stop()  # jobs die with their nodes
        for proc in (self._ctld, self._munged):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- helpers -------------------------------------------------------------------------------------------
    def slurm(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster, from outside the nodes."""
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)

    def logs(self) -> str:
        """The tail of every daemon log, for a failing test's message."""
        tails = [f"--- {f}\n{f.read_text()[-2000:]}" for f in sorted((self.dir / "log").glob("*"))]
        return "\n".join(tails)

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {what}\n{self.logs()}")
            time.sleep(0.2)

    def _ensure_munge(self) -> None:
        """munged serves every node through its socket on the shared filesystem; started here when down."""
        if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
            return
        Path("/run/munge").mkdir(exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        self._munged = subprocess.Popen(
            ["runuser", "-u", "munge", "--", _MUNGED, "--foreground", "--force"],
            env=self.env,
            stdout=open(self.dir / "log" / "munged.out", "ab"),  # noqa: SIM115 - written for munged's life
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._wait(
            lambda: subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0,
            15,
            "munged",
        )

    def _config(self) -> str:
        d, host = self.dir, socket.gethostname().split(".")[0]
        # every namespace shares the host name: nodes are told apart by NodeName/NodeAddr (slurmd -N)
        nodes = "\n".join(
            f"NodeName={self.node_name(i)} NodeHostname={host} NodeAddr={self.node_ip(i)} CPUs={cpus:g} "
            f"RealMemory={self.mem_mb} State=UNKNOWN"
            for i, cpus in enumerate(self._cpus)
        )
        return f"""\
# Written by tests/multinode/slurm_nodes.py: {len(self._cpus)} node(s) in network namespaces, no accounting.
ClusterName=relaxmn{self.net}
SlurmctldHost={host}({self.ctld_ip})
SlurmctldPort={self.ctld_port}
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
FirstJobId={self.net}0001
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# a job released early (scontrol update StartTime=now+3) starts within a second, not at the next 30 s pass
SchedulerParameters=bf_interval=1
MpiDefault=none
MailProg=/bin/true
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
MinJobAge=300
InactiveLimit=0
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
