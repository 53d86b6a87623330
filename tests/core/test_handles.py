"""Role groups without Ray (``cluster=in_process``): the same calls as on Ray actors, run in this process."""

from __future__ import annotations

import os
import threading

import pytest
import ray

from relax_core.runtime import handles
from relax_core.runtime.groups import RoleGroup
from relax_core.weight_transfer import same_process


class Counter:
    """A role-like plain class."""

    def __init__(self, start: int, replica: int = -1) -> None:
        self.value, self.replica, self.closed = start, replica, False

    def add(self, k: int) -> int:
        self.value += k
        return self.value

    def split(self) -> tuple[int, int, int]:
        return self.value, self.replica, os.getpid()

    def fail(self) -> None:
        raise ValueError(f"replica {self.replica} refuses")

    def shutdown(self) -> None:
        self.closed = True


@pytest.fixture
def group() -> RoleGroup:
    assert not ray.is_initialized()
    return RoleGroup(Counter, "counter", 2, None, [0, 1], 1.0, 0.0, (10,), pass_replica=True)


def test_replicas_are_objects_of_this_process_called_like_actors(group: RoleGroup) -> None:
    assert handles.get(group.call("add", 5)) == [15, 15]
    assert handles.get(group.call_each("add", [(1,), (2,)])) == [16, 17]
    assert group.call_collective("add", 0) == 16
    value, replica, pid = handles.get(group.actors[1].split.remote())
    assert (value, replica, pid) == (17, 1, os.getpid())
    # num_returns splits a tuple result into one reference each, as Ray does
    refs = group.actors[0].split.options(num_returns=3).remote()
    assert [handles.get(r) for r in refs] == [16, 0, os.getpid()]
    assert handles.wait(list(refs), num_returns=1) == ([refs[0]], list(refs[1:]))
    assert handles.get(group.actors[0].__ray_ready__.remote()) is True
    assert same_process(group.actors[0], group.actors[1])
    assert not ray.is_initialized()  # nothing above started Ray


def test_a_roles_error_surfaces_when_its_result_is_fetched(group: RoleGroup) -> None:
    ref = group.actors[1].fail.remote()  # calling does not raise, like a Ray actor call
    with pytest.raises(ValueError, match="replica 1 refuses"):
        handles.get(ref)
    with pytest.raises(ValueError, match="replica 0 refuses"):
        handles.get(group.call("fail"))


def test_put_references_are_resolved_as_call_arguments(group: RoleGroup) -> None:
    ref = handles.put(7)
    assert isinstance(ref, handles.InProcessRef)  # no Ray in this process: the value itself
    assert handles.get(group.actors[0].add.remote(ref)) == 17


def test_kill_shuts_the_roles_down(group: RoleGroup) -> None:
    roles = [a.role for a in group.actors]
    group.kill()
    assert all(r.closed for r in roles)


class Gate:
    """A role whose call can be held open, to see two replicas work at once."""

    def __init__(self, replica: int = -1) -> None:
        self.open = threading.Event()

    def wait_open(self) -> str:
        assert self.open.wait(30)
        return threading.current_thread().name

    def where(self) -> str:
        return threading.current_thread().name


def test_threaded_replicas_work_side_by_side_and_are_waited_for() -> None:
    """mode=async in one process: each replica runs its calls on threads of its own, as a Ray actor does."""
    group = RoleGroup(Gate, "gate", 2, None, [0, 1], 1.0, 0.0, pass_replica=True, threaded=True)
    held = group.actors[0].wait_open.remote()
    free = group.actors[1].where.remote()
    assert handles.wait([held, free], num_returns=1, timeout=30) == ([free], [held])
    assert handles.get(free).startswith("gate-1")
    with pytest.raises(TimeoutError):
        handles.get(held, timeout=0.2)
    # the replica's second thread answers while the first is held (a health check, an abort)
    assert handles.get(group.actors[0].where.remote(), timeout=30).startswith("gate-0")
    group.actors[0].role.open.set()
    assert handles.get([held], timeout=30)[0].startswith("gate-0")
    assert handles.wait([], num_returns=1, timeout=0) == ([], [])
    both = [group.actors[1].where.remote(), group.actors[0].where.remote()]
    assert handles.wait(both, num_returns=2, timeout=30) == (both, [])  # waits for both
    group.kill()
    assert not ray.is_initialized()
