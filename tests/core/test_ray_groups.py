"""RoleGroup on a real local Ray: a plain class becomes N actors pinned to placement-group bundles."""

from __future__ import annotations

import atexit
import glob
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import ray
from ray import cloudpickle
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from tiers import heavy

from relax_core.runtime.groups import RoleGroup, SharedProcesses

# the workers cannot import this test module by name: ship its classes by value
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Counter:
    """A role-like plain class: no Ray in it."""

    def __init__(self, start: int, replica: int = -1) -> None:
        self.value, self.replica = start, replica

    def add(self, k: int) -> int:
        self.value += k
        return self.value

    def whoami(self) -> tuple[int, int]:
        return self.replica, os.getpid()

    def placement_group_id(self) -> str | None:
        return ray.get_runtime_context().get_placement_group_id()


@pytest.fixture(scope="module")
@heavy("starts a local Ray")
def ray_cluster():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture
def pg(ray_cluster):
    group = placement_group([{"CPU": 0.5}, {"CPU": 0.5}], strategy="PACK")
    ray.get(group.ready(), timeout=120)
    yield group
    remove_placement_group(group)


def test_role_group_replicas_calls_and_restart(pg) -> None:
    group = RoleGroup(
        Counter, "counter", 2, pg, [0, 1], num_cpus=0.1, num_gpus=0, args=(10,), pass_replica=True
    )
    try:
        assert len(group) == 2
        who = ray.get(group.call("whoami"))
        assert [r for r, _ in who] == [0, 1]
        assert who[0][1] != who[1][1]  # separate processes
        assert ray.get(group.call("add", 5)) == [15, 15]
        assert ray.get(group.call_each("add", [(1,), (2,)])) == [16, 17]
        with pytest.raises(ValueError):
            group.call_each("add", [(1,)])  # one argument tuple per replica
        # actors are named after the group and replica
        assert ray.get(ray.get_actor("counter-1").add.remote(0)) == 17
        # a restarted replica is a fresh instance in the same bundle; the other keeps its state
        old_pid = who[1][1]
        handle = group.restart(1)
        assert group.restarts == [0, 1] and group.actors[1] is handle
        assert ray.get(handle.whoami.remote())[0] == 1
        assert ray.get(handle.whoami.remote())[1] != old_pid
        assert ray.get(group.call("add", 0)) == [16, 10]
        assert ray.get(ray.get_actor("counter-1-r1").add.remote(0)) == 10
    finally:
        group.kill()
    # ray.kill is asynchronous: a call racing it may still be served, but the actor must die shortly
    deadline = time.monotonic() + 60
    with pytest.raises(ray.exceptions.RayActorError):
        while time.monotonic() < deadline:
            ray.get(group.actors[0].add.remote(1), timeout=60)
            time.sleep(0.2)


def test_role_group_without_replica_argument_and_bundle_pinning(pg) -> None:
    group = RoleGroup(Counter, "plain", 2, pg, [1, 1], num_cpus=0.1, num_gpus=0, args=(3,))
    try:
        assert [r for r, _ in ray.get(group.call("whoami"))] == [-1, -1]  # constructor got no replica
        table = placement_group_table(pg)
        assert table["state"] == "CREATED"
        # both actors fit in bundle 1 (0.5 CPU) because each asks for 0.1
        assert ray.get(group.call("add", 1)) == [4, 4]
        assert ray.get(group.call("placement_group_id")) == [pg.id.hex()] * 2
    finally:
        group.kill()


class Doubler:
    """A second role-like class; ``add`` has the same name as Counter's and must not be confused with it."""

    def __init__(self, factor: int, replica: int = -1) -> None:
        self.factor, self.replica = factor, replica

    def add(self, k: int) -> int:
        return self.factor * k

    def whoami(self) -> tuple[int, int]:
        return self.replica, os.getpid()

    def pair(self, a: int, b: int = 0) -> tuple[int, int]:
        return a, b


def test_groups_sharing_processes_reach_their_own_role_in_one_process(pg) -> None:
    shared = SharedProcesses(pg, "counter-doubler", ["counter", "doubler"])
    counters = RoleGroup(Counter, "counter", 2, pg, [0, 1], 0.1, 0, (10,), pass_replica=True, shared=shared)
    doublers = RoleGroup(Doubler, "doubler", 2, pg, [0, 1], 0.1, 0, (3,), pass_replica=True, shared=shared)
    try:
        # replica i of both groups is one process; the processes differ between replicas
        counter_who, doubler_who = ray.get(counters.call("whoami")), ray.get(doublers.call("whoami"))
        assert counter_who == doubler_who and [r for r, _ in counter_who] == [0, 1]
        assert counter_who[0][1] != counter_who[1][1]
        # the same method name on each role reaches that role's object
        assert ray.get(counters.call("add", 5)) == [15, 15]
        assert ray.get(doublers.call("add", 5)) == [15, 15]
        assert ray.get(counters.call("add", 1)) == [16, 16] and ray.get(doublers.call("add", 1)) == [3, 3]
        # keyword arguments, ObjectRef arguments (resolved as for an actor call) and call options
        ref = ray.put(7)
        assert ray.get(doublers.actors[0].pair.remote(ref, b=2)) == (7, 2)
        first, second = counters.actors[1].whoami.options(num_returns=2).remote()
        assert ray.get(first) == 1
        # Ray's own calls reach the process: readiness pings, __ray_call__
        pid = ray.get(doublers.actors[1].__ray_call__.remote(lambda self: os.getpid()))
        assert pid == counter_who[1][1]
        assert ray.get(ray.get_actor("counter-doubler-0").__ray_ready__.remote())
        # one role cannot come back alone: the process holds the other's state too
        with pytest.raises(RuntimeError, match="shares its process"):
            counters.restart(0)
    finally:
        counters.kill()
        doublers.kill()
    deadline = time.monotonic() + 60
    with pytest.raises(ray.exceptions.RayActorError):
        while time.monotonic() < deadline:
            ray.get(doublers.actors[0].add.remote(1), timeout=60)
            time.sleep(0.2)


class SlowToExit:
    """A role whose process lingers while it exits, as one whose libraries flush or join threads at exit."""

    def __init__(self, marker: str, replica: int = -1) -> None:
        self.marker = marker
        atexit.register(self._linger)

    def _linger(self) -> None:
        Path(self.marker).touch()
        time.sleep(60)

    def pid(self) -> int:
        return os.getpid()


def worker_log(pid: int) -> str:
    logs = os.path.join(ray._private.worker.global_worker.node.get_session_dir_path(), "logs")
    (path,) = glob.glob(os.path.join(logs, f"worker-*-{pid}.err"))
    return Path(path).read_text()


@pytest.mark.parametrize("shared", [False, True], ids=["own_process", "shared_process"])
def test_a_sigterm_while_the_actor_exits_ends_it_without_a_traceback(
    pg, tmp_path: Path, shared: bool
) -> None:
    """The launcher's ray.shutdown signals actors Ray is still ending gracefully; their log stays clean."""
    marker = tmp_path / "exiting"
    processes = SharedProcesses(pg, "slow-pair", ["slow", "counter"]) if shared else None
    group = RoleGroup(SlowToExit, "slow", 1, pg, [0], 0.1, 0, (str(marker),), shared=processes)
    if shared:
        RoleGroup(Counter, "counter", 1, pg, [0], 0.1, 0, (0,), shared=processes)
    pid = ray.get(group.actors[0].pid.remote())
    group.actors[0].__ray_terminate__.remote()  # what dropping the last handle does
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), "the actor never reached its exit handlers"
    os.kill(pid, signal.SIGTERM)
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}"), "the signalled actor is still there"
    log = worker_log(pid)
    assert "Traceback" not in log and "SystemExit" not in log, log
