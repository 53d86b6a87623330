"""RoleGroup on a real local Ray: a plain class becomes N actors pinned to placement-group bundles."""

from __future__ import annotations

import os
import sys
import time

import pytest
import ray
from ray import cloudpickle
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from relax_core.ray_groups import RoleGroup

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
