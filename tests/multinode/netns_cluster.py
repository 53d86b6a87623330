"""A Ray cluster of several nodes on one machine, each node in its own network and mount namespace.

Node ``i`` is a network namespace with address ``10.<net>.0.<i+1>`` on a bridge (veth pairs; traffic never
leaves the bridge), its own loopback (so ``127.0.0.1`` on one node is not another's), its own ``/dev/shm``
(shared memory does not cross nodes, as on real machines) and its own node-local folder
(:attr:`NetnsCluster.local_dir`, the same path on every node, a different folder behind it). Everything else
of the filesystem is shared, as a cluster's shared filesystem would be: run dirs under ``/tmp`` are seen by
every node. Node 0 runs the Ray head; the others join it.

Each node is anchored by one process (``sleep infinity``) that owns its mount namespace; every process of the
node, its raylet and the driver alike, is entered into that anchor's namespaces with ``nsenter``. Losing a node
is ``kill_node``: SIGKILL to every process in its network namespace at once.

Needs root and ``ip``/``nsenter``/``unshare`` (CI runs as root); :func:`skip_reason` says why not otherwise.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

RAY_PORT = 6379
# the anchor's namespaces hold the node's private mounts; a node's processes join them
_ANCHOR = (
    "set -e; mount -t tmpfs -o size={shm} tmpfs /dev/shm; mkdir -p {local}; "
    "mount -t tmpfs -o size=512m tmpfs {local}; exec sleep infinity"
)


def skip_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "nsenter", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"missing {', '.join(missing)}"
    probe = f"relaxprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sh(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")


class NetnsCluster:
    """``NetnsCluster(cpus=[2, 1, 1])`` is a head with 2 Ray CPUs and two workers with 1 each.

    Use as a context manager (or call :meth:`start` / :meth:`stop`). ``ray_env`` is the environment every Ray
    process and driver gets (``RAY_AUTH_MODE=disabled`` and the like).
    """

    def __init__(
        self,
        cpus: Sequence[float],
        *,
        net: int = 77,
        shm: str = "1g",
        object_store_mb: int = 150,
        ray_env: dict[str, str] | None = None,
    ) -> None:
        self.net = net
        self.tag = f"rx{net}p{os.getpid()}"  # short: interface names are at most 15 characters
        self.bridge = f"{self.tag}br"
        self.shm = shm
        self.object_store_mb = object_store_mb
        self.local_dir = Path(f"/var/tmp/relax-node-local-{self.tag}")
        self.env = {
            **os.environ,
            "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
            **(ray_env or {}),
        }
        self._cpus: list[float] = list(cpus)
        self._anchors: dict[int, subprocess.Popen] = {}
        self._raylets: dict[int, subprocess.Popen] = {}
        self._log_start: dict[int, int] = {}  # where this start of a node's `ray start` begins in its log
        self._started = False

    # -- addresses -----------------------------------------------------------------------------------------
    def node_ip(self, node: int) -> str:
        return f"10.{self.net}.0.{node + 1}"

    @property
    def address(self) -> str:
        """The Ray head's address (``cluster=ray cluster.address=...``)."""
        return f"{self.node_ip(0)}:{RAY_PORT}"

    @property
    def nodes(self) -> list[int]:
        """Nodes whose anchor is alive."""
        return [i for i, anchor in self._anchors.items() if anchor.poll() is None]

    def _netns(self, node: int) -> str:
        return f"{self.tag}n{node}"

    # -- life cycle ----------------------------------------------------------------------------------------
    def __enter__(self) -> NetnsCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._started = True
        try:
            self._start_all()
        except BaseException:  # a failed start leaves nothing running (``__exit__`` is not called then)
            self.stop()
            raise

    def _start_all(self) -> None:
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        _sh("ip", "link", "set", self.bridge, "up")
        # one node after another (raylets joining at once can time out registering), then one check
        for node in range(len(self._cpus)):
            self._launch_ray(node)
            self._wait_started(node, 60.0)
        self._wait_alive(range(len(self._cpus)), 60.0)

    def add_node(self, cpus: float) -> int:
        """A node joining the running cluster; returns its index."""
        self._cpus.append(cpus)
        node = len(self._cpus) - 1
        self.start_node(node)
        return node

    def start_node(self, node: int, timeout_s: float = 60.0) -> None:
        """Bring node ``node`` up (again, after :meth:`kill_node`): namespace, anchor, Ray; waits until Ray
        lists it alive."""
        self._launch_ray(node)
        self._wait_alive([node], timeout_s)

    def _launch_ray(self, node: int) -> None:
        self._start_namespace(node)
        ray = [
            sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
            f"--node-ip-address={self.node_ip(node)}", f"--num-cpus={self._cpus[node]:g}", "--num-gpus=0",
            f"--object-store-memory={self.object_store_mb * 2**20}", "--disable-usage-stats",
        ]  # fmt: skip
        if node == 0:
            ray += ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"]
        else:
            ray += [f"--address={self.address}"]
        # appended: the log keeps every start of the node (a restart, a second cluster of this process)
        log = open(self.log_path(node), "ab")  # noqa: SIM115 - the raylet writes it for its whole life
        self._log_start[node] = log.tell()
        self._raylets[node] = self.popen(node, ray, stdout=log, stderr=subprocess.STDOUT)

    def _start_namespace(self, node: int) -> None:
        """Node ``node`` without Ray: its network namespace (made once) and its anchor holding its private
        mounts."""
        ns = self._netns(node)
        if subprocess.run(["ip", "netns", "pids", ns], capture_output=True).returncode:
            veth = f"{self.tag}v{node}"
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _sh("ip", "link", "set", veth, "master", self.bridge, "up")
            _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.node_ip(node)}/24", "dev", "eth0")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        script = _ANCHOR.format(shm=self.shm, local=self.local_dir)
        self._anchors[node] = subprocess.Popen(
            ["ip", "netns", "exec", ns, "unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            start_new_session=True,
        )
        self._wait_for_mounts(node)

    def _wait_for_mounts(self, node: int) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self._anchors[node].poll() is not None:
                raise RuntimeError(
                    f"node {node}'s namespace anchor exited ({self._anchors[node].returncode})"
                )
            probe = self.run(node, ["sh", "-c", f"mountpoint -q /dev/shm && mountpoint -q {self.local_dir}"])
            if probe.returncode == 0:
                return
            time.sleep(0.05)
        raise RuntimeError(f"node {node}'s private mounts did not appear")

    def _wait_started(self, node: int, timeout_s: float) -> None:
        """Until node ``node``'s ``ray start`` says it is up (it prints that before it blocks)."""
        deadline = time.monotonic() + timeout_s
        while b"Ray runtime started" not in self.log_path(node).read_bytes()[self._log_start[node] :]:
            if self._raylets[node].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"node {node}'s `ray start` did not start Ray; see {self.log_path(node)}")
            time.sleep(0.2)

    def _wait_alive(self, nodes, timeout_s: float) -> None:
        """Until Ray lists every node of ``nodes`` alive."""
        ips = {self.node_ip(n) for n in nodes}
        query = (
            "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
            "print(' '.join(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']))"
        )
        deadline = time.monotonic() + timeout_s
        for node in nodes:
            self._wait_started(node, timeout_s)
        while time.monotonic() < deadline:
            alive = self.run(0, [sys.executable, "-c", query, self.address], timeout=60)
            if alive.returncode == 0 and ips <= set(alive.stdout.split()):
                return
            time.sleep(0.5)
        raise RuntimeError(
            f"nodes {sorted(ips)} did not all join Ray within {timeout_s:g} s (logs: /tmp/{self.tag}-node*.log)"
        )

    def log_path(self, node: int) -> Path:
        return Path(f"/tmp/{self.tag}-node{node}.log")

    def kill_node(self, node: int) -> None:
        """Lose node ``node``: SIGKILL to every process in its network namespace at once (raylet, workers,
        anchor), as when a machine dies. The namespace stays, so :meth:`start_node` can bring it back."""
        pids = subprocess.run(["ip", "netns", "pids", self._netns(node)], capture_output=True, text=True)
        for pid in pids.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in (self._anchors.pop(node, None), self._raylets.pop(node, None)):
            if proc is not None:
                proc.wait(timeout=30)

    def stop(self) -> None:
        """Kill every node's processes, delete the namespaces, the bridge and the node-local folder."""
        if not self._started:
            return
        for node in range(len(self._cpus)):
            self.kill_node(node)
            subprocess.run(["ip", "netns", "del", self._netns(node)], capture_output=True)
            subprocess.run(["ip", "link", "del", f"{self.tag}v{node}"], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        shutil.rmtree(self.local_dir, ignore_errors=True)
        self._started = False

    # -- running things on a node --------------------------------------------------------------------------
    def _enter(self, node: int) -> list[str]:
        anchor = self._anchors.get(node)
        if anchor is None or anchor.poll() is not None:
            raise RuntimeError(f"node {node} is down")
        return ["nsenter", f"--target={anchor.pid}", "--net", "--mount", "--"]

    def popen(self, node: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` on node ``node`` (its own session, so a test can signal the whole group)."""
        kwargs.setdefault("env", self.env)
        kwargs.setdefault("start_new_session", True)
        return subprocess.Popen([*self._enter(node), *argv], **kwargs)

    def run(
        self, node: int, argv: Sequence[str], timeout: float | None = None, **kwargs
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` on node ``node`` to its end; text output captured."""
        kwargs.setdefault("env", self.env)
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run([*self._enter(node), *argv], timeout=timeout, **kwargs)
