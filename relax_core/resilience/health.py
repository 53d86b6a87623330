"""HealthManager: watches every role actor of a run and decides how to recover when one fails.

* **Heartbeats.** A daemon thread in the driver pings every replica of every role group each
  ``trainer.heartbeat_interval_s`` (Ray's built-in ``__ray_ready__`` call, answered on the actor's spare
  concurrency slot even while it is busy). A replica whose process is gone fails the ping at once; one
  that has not answered for ``trainer.heartbeat_timeout_s`` is hung and is killed, so that whatever the
  loop is waiting on fails instead of blocking forever.
* **In-place restart.** When a step fails because a role actor died (a ``RayActorError`` from ``ray.get``),
  the dead replicas are replaced by fresh actors in their placement-group bundles, rollout engines get the
  current weights, the data stream is rewound to where the step began and the step runs again. The step is
  neither lost nor repeated: its prompts are drawn again from the same position. Reward worker processes
  are restarted by the reward executor itself (``relax_rewards.executor``).
* **Global restart.** The Actor holds optimizer state no copy of which exists outside it, so losing it (or
  a replica restarted ``trainer.max_role_restarts`` times) restarts every role and resumes from the last
  checkpoint (``trainer.save_every`` must be > 0). After ``cluster.max_global_restarts`` such restarts the
  run fails with :class:`RunFailedError`, whose message (and ``<output_dir>/failure_report.json``) says
  what failed.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_core.errors import ClusterTooSmall, RunFailedError
from relax_core.runtime import handles
from relax_core.runtime.groups import RoleGroup
from relax_core.runtime.ray_errors import GetTimeoutError, RayActorError, WorkerCrashedError
from relax_core.weight_transfer.collective import BroadcastPeerLost

if TYPE_CHECKING:
    from relax_core.config.schema import TrainerConfig

log = logging.getLogger("relax")

# losing one of these cannot be repaired in place: their optimizer state lives only in the process
GLOBAL_ROLES = ("actor", "critic")
# a role's process died: its own error, or a weight broadcast that lost a member (its node died)
ACTOR_FAILURES = (RayActorError, WorkerCrashedError, BroadcastPeerLost)
# how long a replacement may wait for a node to hold its bundle before the run restarts from its checkpoint
PLACE_TIMEOUT_S = 10.0
# how long a global restart waits for nodes to hold every role (a lost node coming back, a new one)
NODE_WAIT_S = 600.0


def reward_problem(value: float, max_abs: float) -> str | None:
    """Why a reward may not reach a gradient (``None``: it may): non-finite, or beyond ``reward.max_abs``,
    where squares and sums of a step's rewards would overflow the float32 advantages into inf/NaN."""
    if not math.isfinite(value):
        return f"reward {value} is not finite"
    if abs(value) > max_abs:
        return f"reward {value:g} is outside ±reward.max_abs={max_abs:g}"
    return None


def apply_reward(sample, outcome, max_abs: float) -> None:
    """Fill ``sample``'s reward and extras from the executor's ``outcome``; a failed call, or a reward
    :func:`reward_problem` refuses, is a counted reward error."""
    sample.reward = outcome.reward
    sample.reward_extras = dict(outcome.extras) | {"reward_error": 0.0}
    error = outcome.error or reward_problem(outcome.reward, max_abs)
    if error is not None:
        mark_reward_error(sample, error)


def mark_reward_error(sample, error: str) -> None:
    """Score ``sample`` 0 as a counted reward error; its metadata (a copy: a prompt's samples share one
    dict) keeps the error, which a stopped run quotes."""
    sample.reward = 0.0
    sample.reward_extras = {k: v for k, v in sample.reward_extras.items() if math.isfinite(v)}
    sample.reward_extras["reward_error"] = 1.0
    sample.metadata = dict(sample.metadata or {}) | {"reward_error": error}


class TrainingGuard:
    """Stops a run that is training on nothing valid, instead of letting it end "finished".

    A step is bad when more than ``trainer.max_bad_share`` of its samples are reward errors
    (``reward/reward_error``) or of its optimizer updates were skipped for a non-finite loss or gradient
    norm (``train/skipped_steps``). ``trainer.max_bad_steps`` bad steps in a row (0: never), or a run
    whose every step up to the last was bad, fail with :class:`RunFailedError` naming the cause and an
    example error.
    """

    def __init__(self, trainer_cfg: TrainerConfig) -> None:
        self.max_bad_steps = trainer_cfg.max_bad_steps
        self.max_share = trainer_cfg.max_bad_share
        self.total_steps = trainer_cfg.total_steps
        self.streak = 0
        self.seen = 0

    def check(self, step: int, metrics: dict[str, float], example: str | None = None) -> None:
        """Count ``step``; raises :class:`RunFailedError` when the run must stop."""
        self.seen += 1
        errors = metrics.get("reward/reward_error", 0.0)
        skipped = metrics.get("train/skipped_steps", 0.0) / max(metrics.get("optimizer_steps", 1.0), 1.0)
        if errors <= self.max_share and skipped <= self.max_share:
            self.streak = 0
            return
        self.streak += 1
        whole_run = step >= self.total_steps and self.streak == self.seen
        if not self.max_bad_steps or (self.streak < self.max_bad_steps and not whole_run):
            return
        if errors > self.max_share:
            cause = f"{errors:.0%} of the samples were reward errors (scored 0)"
            fix = "fix the reward or the dataset's labels"
        else:
            cause = "the loss or gradient norm was not finite, so the optimizer step was skipped"
            fix = "lower trainer.lr or check the rewards"
        where = f"step {step}" if self.streak == 1 else f"steps {step - self.streak + 1}-{step}"
        shown = f"; e.g. {example}" if example else ""
        raise RunFailedError(
            f"{where}: {cause}{shown}; stopped after {self.streak} such step(s) "
            f"(trainer.max_bad_steps={self.max_bad_steps}, trainer.max_bad_share={self.max_share}): {fix}"
        )


class GlobalRestartNeeded(Exception):
    """Raised inside the step loop: restart every role from the last checkpoint."""


@dataclass
class HealthEvent:
    time: float
    kind: str  # "dead", "hung", "restart", "global_restart", "give_up"
    role: str
    replica: int
    step: int
    detail: str = ""


@dataclass
class HealthCounters:
    role_restarts: int = 0
    global_restarts: int = 0
    step_retries: int = 0
    events: list[HealthEvent] = field(default_factory=list)


class HealthManager:
    """One per run, in the driver. ``groups()`` returns every role group it watches (all of a run's roles,
    by name); ``on_replaced(role, index, handle)`` is told of every replica restarted in place, so the
    mode can bring it to the current weights."""

    def __init__(
        self,
        groups: Callable[[], dict[str, RoleGroup]],
        trainer_cfg: TrainerConfig,
        max_global_restarts: int,
        output_dir: str,
        on_replaced: Callable[[str, int, Any], None],
    ) -> None:
        self.groups = groups
        self.on_replaced = on_replaced
        self.output_dir = output_dir
        self.interval = trainer_cfg.heartbeat_interval_s
        self.timeout = trainer_cfg.heartbeat_timeout_s
        self.max_role_restarts = trainer_cfg.max_role_restarts
        self.max_global_restarts = max_global_restarts
        self.counters = HealthCounters()
        self.current_step = 0
        self._last_seen: dict[tuple[str, int], float] = {}
        self._failures: dict[int, int] = {}  # step -> failed attempts
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ heartbeats
    def start(self) -> None:
        now = time.monotonic()
        with self._lock:
            self._last_seen = {(name, i): now for name, g in self.groups().items() for i in range(len(g))}
        if self.interval > 0 and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._beat, name="relax-health", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 5)
            self._thread = None

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.heartbeat_once()
            except Exception as err:  # the watcher must never take the run down
                log.debug("heartbeat round failed: %s", err)

    def heartbeat_once(self) -> dict[tuple[str, int], str]:
        """Ping every replica once; returns {(role, replica): "ok" | "dead" | "late" | "hung"}."""
        with self._lock:
            targets = [(name, i, a) for name, g in self.groups().items() for i, a in enumerate(g.actors)]
        refs = {a.__ray_ready__.remote(): (name, i) for name, i, a in targets}
        ready, _ = handles.wait(list(refs), num_returns=len(refs), timeout=max(self.interval, 1.0))
        status: dict[tuple[str, int], str] = {}
        now = time.monotonic()
        for ref in ready:
            key = refs[ref]
            try:
                handles.get(ref)
                status[key] = "ok"
                with self._lock:
                    self._last_seen[key] = now
            except ACTOR_FAILURES:
                status[key] = "dead"
        for key in refs.values():
            if key in status:
                continue
            with self._lock:
                silent = now - self._last_seen.get(key, now)
            status[key] = "hung" if silent > self.timeout else "late"
        for (name, i), state in status.items():
            if state == "hung":  # kill it: the loop's ray.get on it fails and recovery takes over
                self._event("hung", name, i, f"no heartbeat for {self.timeout:.0f}s; killed")
                group = self.groups().get(name)
                if group is not None:
                    group.kill_replica(i)
        return status

    def _dead_replicas(self) -> list[tuple[str, int]]:
        """Replicas whose process is gone (a ping that fails, not one that is merely slow)."""
        with self._lock:
            targets = [(name, i, a) for name, g in self.groups().items() for i, a in enumerate(g.actors)]
        dead = []
        for name, i, actor in targets:
            try:
                handles.get(actor.__ray_ready__.remote(), timeout=max(self.timeout, 10.0))
            except (*ACTOR_FAILURES, GetTimeoutError):
                dead.append((name, i))
        return dead

    # ------------------------------------------------------------------ recovery
    def run_step(self, step: int, fn: Callable[[int], dict[str, float]], stream) -> dict[str, float]:
        """``fn(step)`` with in-place recovery; raises :class:`GlobalRestartNeeded` when that cannot work.
        ``stream`` (the prompt stream) is rewound before a retry, so the step draws the same prompts."""
        self.current_step = step
        stream_state = stream.state_dict()
        while True:
            try:
                metrics = fn(step)
                return metrics | self.metrics()
            except ACTOR_FAILURES as err:
                self.step_failed(step, err)
                stream.load_state_dict(stream_state)  # the same prompts again: no step lost

    def step_failed(self, step: int, err: BaseException) -> list[tuple[str, int]]:
        """A step failed with a role actor's error: replace the dead replicas in place and count a retry.
        Gives up with :class:`RunFailedError` when the same step failed more than ``max_role_restarts``+1
        times (e.g. an error that no restart cures); returns the replicas that were replaced."""
        log.warning("step %d: a process of the run failed (%s); recovering", step, type(err).__name__)
        self._failures[step] = self._failures.get(step, 0) + 1
        if self._failures[step] > self.max_role_restarts + 1:
            self._event("give_up", "run", 0, f"step {step} failed {self._failures[step]} times")
            raise self._fail(f"step {step} failed {self._failures[step]} times; last error: {_one_line(err)}")
        replaced = self.recover_in_place(step)
        self.counters.step_retries += 1
        return replaced

    def guarded(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` (an eval or a checkpoint save between steps) with the recovery of a step: a dead engine is
        replaced in place and ``fn`` retried; a dead Actor raises :class:`GlobalRestartNeeded`."""
        while True:
            try:
                return fn()
            except ACTOR_FAILURES as err:
                self.step_failed(self.current_step + 1, err)

    def retrying(self, fn: Callable[[], Any], what: str) -> Any:
        """``fn()`` retried after replacing dead replicas in place, at most ``max_role_restarts`` times.

        For work after the Actor's optimizer step (publishing the new weights): re-running the whole step
        would train on the same batch twice.
        """
        for _ in range(self.max_role_restarts + 1):
            try:
                return fn()
            except ACTOR_FAILURES as err:
                log.warning("%s: a role actor failed (%s); recovering", what, type(err).__name__)
                self.recover_in_place(self.current_step)
        return fn()

    def recover_in_place(self, step: int) -> list[tuple[str, int]]:
        """Restart the dead replicas in place (raises :class:`GlobalRestartNeeded` for a global role or one
        out of restarts); returns them."""
        dead = self._dead_replicas()
        if not dead:  # the failure was transient from the loop's point of view; retry as is
            return []
        groups = self.groups()
        for name, i in dead:
            self._event("dead", name, i, "process gone or unresponsive")
        # every replica that cannot be replaced in place is named: one dying beside the Actor is news too
        lost = [
            f"{name}-{i} died"
            for name, i in dead
            if name in GLOBAL_ROLES or groups[name].collective or groups[name].shared is not None
        ]
        if lost:
            raise GlobalRestartNeeded("; ".join(lost))
        for name, i in dead:
            group = groups[name]
            if group.restarts[i] >= self.max_role_restarts:
                raise GlobalRestartNeeded(f"{name}-{i} failed after {group.restarts[i]} in-place restarts")
        for name, i in dead:
            with self._lock:
                groups[name].restart(i)
                self._last_seen[(name, i)] = time.monotonic()
            self.counters.role_restarts += 1
            self._event("restart", name, i, f"restart {groups[name].restarts[i]} in place")
        self._await_replacements(groups, dead)
        for name, i in dead:
            self.on_replaced(name, i, groups[name].actors[i])
        return dead

    def _await_replacements(self, groups: dict[str, RoleGroup], dead: list[tuple[str, int]]) -> None:
        """Wait until the replacements are constructed and alive. A replacement whose placement group has a
        bundle no node can hold any more (its node was lost and no other has room) would wait forever:
        after ``PLACE_TIMEOUT_S`` of that, restart from the checkpoint on what is left instead."""
        refs = [groups[n].actors[i].__ray_ready__.remote() for n, i in dead]
        unplaced_since = None
        while len(handles.wait(refs, num_returns=len(refs), timeout=1.0)[0]) < len(refs):
            unplaced = [f"{n}-{i}" for n, i in dead if not _bundles_placed(groups[n].pg)]
            if not unplaced:
                unplaced_since = None
                continue
            unplaced_since = unplaced_since or time.monotonic()
            if time.monotonic() - unplaced_since > PLACE_TIMEOUT_S:
                raise GlobalRestartNeeded(
                    f"{', '.join(unplaced)} found no node with room for its bundle (a node was lost)"
                )
        handles.get(refs)

    def start_when_room(self, start: Callable[[], Any], stop: Callable[[], None]) -> None:
        """``start()`` every role again after a global restart. While the cluster is short of what they
        need (a lost node held the Actor and no other can), stop what started and wait for a node to come
        back or join, up to ``NODE_WAIT_S``; then the shortage is the run's error."""
        deadline = time.monotonic() + NODE_WAIT_S
        while True:
            try:
                return start()
            except ClusterTooSmall as short:
                if time.monotonic() > deadline:
                    raise
                stop()
                left = deadline - time.monotonic()
                log.warning("global restart: %s; waiting for a node to join (%.0f s more)", short, left)
                time.sleep(5.0)

    def begin_global_restart(self, reason: str) -> None:
        """Count a global restart; fail the run with a report when they are exhausted."""
        self.counters.global_restarts += 1
        self._event("global_restart", "run", 0, reason)
        if self.counters.global_restarts > self.max_global_restarts:
            self._event("give_up", "run", 0, f"more than {self.max_global_restarts} global restarts")
            raise self._fail(f"{reason}; gave up after {self.max_global_restarts} global restarts")

    def global_restart(self, reason: str, checkpoints_root) -> Path:
        """Count a global restart and return the newest checkpoint to restart every role from."""
        from relax_core.resilience.checkpoint import latest_checkpoint

        self.begin_global_restart(reason)
        ckpt = latest_checkpoint(checkpoints_root)
        if ckpt is None:
            self._event("give_up", "run", 0, "no checkpoint to restart from (set trainer.save_every > 0)")
            raise self._fail(f"{reason}; no checkpoint to restart from (set trainer.save_every > 0)")
        return ckpt

    def _fail(self, headline: str) -> RunFailedError:
        self.write_report(self.output_dir, headline)
        return RunFailedError(self.report(headline))

    def metrics(self) -> dict[str, float]:
        return {
            "health/role_restarts": float(self.counters.role_restarts),
            "health/global_restarts": float(self.counters.global_restarts),
            "health/step_retries": float(self.counters.step_retries),
        }

    # ------------------------------------------------------------------ state and reporting
    def _event(self, kind: str, role: str, replica: int, detail: str) -> None:
        event = HealthEvent(time.time(), kind, role, replica, self.current_step, detail)
        self.counters.events.append(event)
        log.warning("health: %s %s-%d at step %d: %s", kind, role, replica, self.current_step, detail)

    def state_dict(self) -> dict[str, Any]:
        return {
            "role_restarts": self.counters.role_restarts,
            "global_restarts": self.counters.global_restarts,
            "step_retries": self.counters.step_retries,
            "events": [asdict(e) for e in self.counters.events],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Counters survive a resume; the global-restart count is kept from this process (it is higher)."""
        self.counters.role_restarts = max(self.counters.role_restarts, state.get("role_restarts", 0))
        self.counters.step_retries = max(self.counters.step_retries, state.get("step_retries", 0))
        self.counters.global_restarts = max(self.counters.global_restarts, state.get("global_restarts", 0))
        known = {(e.time, e.kind) for e in self.counters.events}
        restored = [HealthEvent(**e) for e in state.get("events", []) if (e["time"], e["kind"]) not in known]
        self.counters.events = sorted(restored + self.counters.events, key=lambda e: e.time)

    def report(self, headline: str) -> str:
        lines = [f"run failed: {headline}"]
        for e in self.counters.events:
            lines.append(f"  step {e.step}: {e.kind} {e.role}-{e.replica}: {e.detail}")
        return "\n".join(lines)

    def write_report(self, output_dir: str, headline: str) -> Path:
        path = Path(output_dir) / "failure_report.json"
        path.write_text(json.dumps({"headline": headline, **self.state_dict()}, indent=2))
        return path


def _bundles_placed(pg: Any) -> bool:
    """Whether every bundle of placement group ``pg`` lies on a live node (Ray moves the bundles of a lost
    node to others with room; until then the group is rescheduling); True without Ray."""
    if pg is None:
        return True
    from ray.util import placement_group_table

    return placement_group_table(pg).get("state") == "CREATED"


def _one_line(err: BaseException) -> str:
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"
