"""A step that keeps failing with a role actor's error although no role is dead (nothing to replace) is
retried a bounded number of times, then the run fails with one line naming the error; a recovery that
finds several processes dead which only a restart from the checkpoint can replace names every one."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import ray

from relax_core.resilience.health import GlobalRestartNeeded, HealthManager, RunFailedError


@ray.remote
class Callee:
    def ping(self) -> str:
        return "pong"


@ray.remote
class Caller:
    def call(self, other) -> str:
        return ray.get(other.ping.remote())


TRAINER = SimpleNamespace(heartbeat_interval_s=0, heartbeat_timeout_s=10, max_role_restarts=1)


def wait_until_dead(actor, polls: int = 600) -> None:
    for _ in range(polls):
        try:
            ray.get(actor.ping.remote())
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError("ray.kill did not take effect")


def test_a_step_failing_without_a_dead_role_gives_up_naming_the_error(ray_cluster, tmp_path) -> None:
    callee, caller = Callee.remote(), Caller.remote()
    assert ray.get(caller.call.remote(callee)) == "pong"
    ray.kill(callee)  # every later call through the (alive) caller fails with ActorDiedError
    wait_until_dead(callee)  # ray.kill is asynchronous: a call right after it may still be answered
    health = HealthManager(lambda: {}, TRAINER, 0, str(tmp_path), lambda *a: None)
    stream = SimpleNamespace(state_dict=dict, load_state_dict=lambda state: None)
    attempts = []

    def step(n: int) -> dict[str, str]:
        attempts.append(n)
        return {"reply": ray.get(caller.call.remote(callee))}

    with pytest.raises(RunFailedError) as failed:
        health.run_step(7, step, stream)
    assert attempts == [7, 7, 7]  # the first try and max_role_restarts + 1 retries
    headline = str(failed.value).splitlines()[0]
    assert (
        headline.startswith("run failed: step 7 failed 3 times; last error: ")
        and "ActorDiedError" in headline
    )
    assert (tmp_path / "failure_report.json").is_file()


def test_a_recovery_that_finds_the_actor_and_the_critic_dead_names_both(ray_cluster, tmp_path) -> None:
    actor, critic = Callee.remote(), Callee.remote()
    for replica in (actor, critic):
        ray.kill(replica)
        wait_until_dead(replica)

    def group(replica) -> SimpleNamespace:  # what the health manager reads of a RoleGroup
        return SimpleNamespace(actors=[replica], collective=False, shared=None, restarts=[0])

    groups = {"actor": group(actor), "critic": group(critic)}
    health = HealthManager(lambda: groups, TRAINER, 1, str(tmp_path), lambda *a: None)
    with pytest.raises(GlobalRestartNeeded) as restart:
        health.recover_in_place(3)
    assert str(restart.value) == "actor-0 died; critic-0 died"
    assert [(e.kind, e.role) for e in health.counters.events] == [("dead", "actor"), ("dead", "critic")]
