"""``mode=async``: every role is its own Ray actor group, samples move through the DataBus, weights
through WeightSync, and a small scheduler in the driver decides what may start when.

Pipeline of one step N (partition ``train_N`` on the bus)::

    Rollout ── tokens, masks, rollout log-probs, rewards (whole prompt groups, as each chunk finishes;
      │          DAPO: shaped rewards, only groups with reward spread, more rounds until the step is full)
      ├─► Critic     ── values          (PPO; then it trains its value loss on the whole step)
      ├─► Teacher    ── teacher log-probs (on-policy distillation)
      ├─► Reference  ── ref log-probs   (when algorithm.kl_loss_coef or kl_reward_coef > 0)
      ├─► ActorFwd   ── old log-probs   (only when a rollout batch is split into several optimizer steps)
      ├─► Advantages ── advantages      (group-local estimators: per group as it lands; others: per step;
      │                                  after the values / teacher / ref log-probs they use)
      └─► Actor: streams micro-batches as soon as their fields are ready; optimizer step; weights v=N
                 are broadcast to rollout engines / ActorFwd (/ Reference) while it trains step N+1.

Staleness is counted in policy versions (version k = weights after k RL steps; the warm-started policy
is version 0). Rollout may start step N+1 only while ``N+1 − oldest_unconsumed_step ≤ max_staleness``, and
only once its engines hold at least version ``N − max_staleness``; so every sample of step N was generated
by a version in ``[N−1−max_staleness, N−1]``, and ``max_staleness=0`` replays colocate exactly.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import replace
from typing import Any

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group

from relax_core.algorithm_roles import (
    FROZEN_ACTOR_METRICS,
    critic_warming_up,
    dynamic_sampling_metrics,
    shape_rewards,
    with_spread,
)
from relax_core.algorithms.masked import masked_mean
from relax_core.algorithms.objective import micro_batch_weight, policy_objective
from relax_core.controller import reward_metrics, split_evenly
from relax_core.databus import DataBus, partition_name, sample_key, start_databus
from relax_core.databus.records import SAMPLE_FIELDS, batch_from_rows, per_sample, sample_rows
from relax_core.engines.base import GenerationRequest, GenerationResult, SamplingParams
from relax_core.errors import RelaxUserError
from relax_core.ray_groups import RoleGroup
from relax_core.roles.actor import Actor
from relax_core.roles.advantages import Advantages
from relax_core.roles.critic import Critic
from relax_core.roles.reference import Reference
from relax_core.roles.rollout import Rollout
from relax_core.roles.teacher import Teacher
from relax_core.samples import Sample
from relax_core.weight_sync import SyncSpec, WeightSyncGroup, free_port, layout_of

log = logging.getLogger("relax")

# estimators whose advantage of a sample depends only on its own prompt group
GROUP_LOCAL_ESTIMATORS = {"grpo", "rloo"}
BUS_CPUS = 0.1
# roles that add fields to a step's rows between Rollout and Actor, in launch order
HELPER_STAGES = ("critic", "teacher", "reference", "actor_fwd", "advantages")


def uses_actor_fwd(cfg) -> bool:
    """Several optimizer steps per rollout batch: the behaviour policy's log-probs come from ActorFwd.
    (One rollout batch == one optimizer batch: old log-probs = detached current, no ActorFwd.)"""
    r, t, a = cfg.rollout, cfg.trainer, cfg.algorithm
    step_samples = r.batch_size * r.n_samples_per_prompt
    return a.ppo_epochs > 1 or (t.global_batch_size or step_samples) < step_samples


def advantage_inputs(cfg) -> list[str]:
    """Per-token fields the Advantages role waits for besides the Rollout's: values (GAE), teacher
    log-probs (distillation), ref log-probs (reward-side KL) and, for the last two, the behaviour log-probs."""
    a = cfg.algorithm
    fields = ["values"] if a.critic is not None else []
    fields += ["teacher_logprobs"] if a.teacher is not None else []
    fields += ["ref_logprobs"] if a.kl_reward_coef > 0 else []
    if uses_actor_fwd(cfg) and (a.teacher is not None or a.kl_reward_coef > 0):
        fields.append("old_logprobs")
    return fields


class StalenessGate:
    """Admission rule for rollout steps: start step ``s`` only while ``s − oldest_unconsumed ≤ max``."""

    def __init__(self, max_staleness: int) -> None:
        if max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        self.max_staleness = max_staleness

    def may_start(self, step: int, oldest_unconsumed_step: int) -> bool:
        return step - oldest_unconsumed_step <= self.max_staleness

    def min_weight_version(self, step: int) -> int:
        """Oldest policy version the rollout engines may hold when they start ``step``."""
        return max(step - 1 - self.max_staleness, 0)


def staleness_metrics(versions: list[int], trained_version: int) -> dict[str, float]:
    """staleness = version the Actor trains from − version that generated the sample (0 = on-policy)."""
    lags = [trained_version - v for v in versions] or [0]
    return {
        "staleness/min": float(min(lags)),
        "staleness/mean": sum(lags) / len(lags),
        "staleness/max": float(max(lags)),
    }


# ---------------------------------------------------------------------------------------- weight followers
class _WeightFollower:
    """Mixin: join weight-sync groups and apply received versions (``apply_weights`` per role)."""

    def ws_join(self, spec: SyncSpec, rank: int) -> None:
        if not hasattr(self, "_ws"):
            self._ws: dict[str, WeightSyncGroup] = {}
        self._ws[spec.name] = WeightSyncGroup(spec, rank)

    def ws_receive(self, name: str, version: int) -> float:
        t = time.perf_counter()
        state = self._ws[name].receive()
        self.apply_weights(state, version)
        return time.perf_counter() - t

    def apply_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        raise NotImplementedError


class ResumableEngine:
    """Wraps a rollout engine so a weight swap can land while it generates.

    ``finish``: the swap waits for the in-flight ``generate`` call, whose samples keep the old version.
    ``abort``: the swap aborts it; the cut-short rows are resumed (prompt + partial response) on the new
    weights and tagged with the older version, the one that produced their first tokens.
    """

    def __init__(self, engine, partial_rollout: str) -> None:
        self.engine = engine
        self.partial_rollout = partial_rollout
        self._lock = threading.Lock()
        self._swap_pending = threading.Event()
        self.swaps = 0
        self.resumed = 0

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def _turn(self) -> threading.Lock:
        while self._swap_pending.is_set():  # let a waiting swap go first
            time.sleep(0.001)
        self._lock.acquire()
        return self._lock

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[GenerationResult]:
        lock = self._turn()
        try:
            results = self.engine.generate(requests, sampling)
        finally:
            lock.release()
        n = max(sampling.n, 1)
        while self.partial_rollout == "abort":
            todo = [i for i, r in enumerate(results) if r.finish_reason == "abort"]
            todo = [i for i in todo if len(results[i].output_ids) < sampling.max_new_tokens]
            if not todo:
                break
            budget = max(sampling.max_new_tokens - len(results[i].output_ids) for i in todo)
            resume = [
                GenerationRequest(
                    requests[i // n].input_ids + results[i].output_ids,
                    requests[i // n].request_id,
                    requests[i // n].multimodal_inputs,
                )
                for i in todo
            ]
            lock = self._turn()
            try:
                more = self.engine.generate(resume, replace(sampling, n=1, max_new_tokens=budget))
            finally:
                lock.release()
            self.resumed += len(todo)
            for i, extra in zip(todo, more, strict=True):
                old = results[i]
                room = sampling.max_new_tokens - len(old.output_ids)
                ids, lps = extra.output_ids[:room], extra.logprobs[:room]
                reason = extra.finish_reason if len(extra.output_ids) <= room else "length"
                results[i] = GenerationResult(
                    old.output_ids + ids,
                    old.logprobs + lps,
                    reason,
                    old.request_id,
                    # the version of the first token: old weights unless aborted before decoding began
                    min(old.weight_version, extra.weight_version) if old.output_ids else extra.weight_version,
                )
        return results

    def swap(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self._swap_pending.set()
        try:
            while not self._lock.acquire(timeout=0.01):
                if self.partial_rollout == "abort":
                    self.engine.abort()
            try:
                self.engine.update_weights(state_dict, version)
                self.swaps += 1
            finally:
                self._lock.release()
        finally:
            self._swap_pending.clear()


# ---------------------------------------------------------------------------------------- bus-facing roles
class BusRollout(_WeightFollower, Rollout):
    """Rollout that writes each finished chunk of prompt groups to the bus."""

    def __init__(self, cfg, model_path: str, bus: DataBus, replica: int = 0) -> None:
        super().__init__(cfg, model_path, replica=replica)
        self.bus = bus
        self.engine = ResumableEngine(self.engine, cfg.mode.partial_rollout)

    def produce(self, step: int, prompts: list, slots: list[int], last_round: bool = True) -> dict[str, Any]:
        """Generate and score ``prompts`` chunk by chunk, writing whole prompt groups into the step's group
        ``slots`` (slot g holds positions g·n … g·n+n−1) as each chunk finishes.

        Dynamic sampling writes only groups with reward spread and stops once its slots are full; in the
        last round the slots still free get zero-spread groups with a zeroed loss mask, so the step keeps
        its size and the Actor's stream its shape, but those groups add nothing to the loss.
        """
        r, a = self.cfg.rollout, self.cfg.algorithm
        n, chunk = r.n_samples_per_prompt, self.cfg.mode.rollout_chunk_prompts or len(prompts)
        out: dict[str, Any] = {"rewards": [], "extras": [], "lens": [], "versions": [], "put_s": 0.0}
        out |= {"filled": [], "kept_groups": 0, "generated_groups": 0, "generated_rewards": []}
        free, spare = list(slots), []
        t0 = time.perf_counter()
        for c in range(0, len(prompts), chunk):
            if not free:
                break
            samples = shape_rewards(self.generate(prompts[c : c + chunk]), a, r.max_new_tokens)
            out["generated_groups"] += len(samples) // n
            out["generated_rewards"] += [s.reward for s in samples]
            kept = with_spread(samples) if a.dynamic_sampling else samples
            kept_ids = {id(s) for s in kept}
            spare += [s for s in samples if id(s) not in kept_ids]
            groups = prompt_groups(kept, n)[: len(free)]
            out["kept_groups"] += len(groups)
            free = self._write(step, groups, free, out)
        if last_round and free:
            filler = [
                [replace(s, loss_mask=[0] * len(s.loss_mask)) for s in g] for g in prompt_groups(spare, n)
            ]
            free = self._write(step, filler[: len(free)], free, out)
        out["wall_s"] = time.perf_counter() - t0
        out["resumed"] = self.engine.resumed
        return out

    def _write(
        self, step: int, groups: list[list[Sample]], free: list[int], out: dict[str, Any]
    ) -> list[int]:
        """Put ``groups`` into the first free slots (one bus call); returns the slots still free."""
        if not groups:
            return free
        n = self.cfg.rollout.n_samples_per_prompt
        used, samples = free[: len(groups)], [s for g in groups for s in g]
        _, fields = sample_rows(samples, 0)
        t = time.perf_counter()
        self.bus.put(partition_name(step), [sample_key(g * n + j) for g in used for j in range(n)], fields)
        out["put_s"] += time.perf_counter() - t
        out["filled"] += used
        out["rewards"] += [s.reward for s in samples]
        out["extras"] += [s.reward_extras for s in samples]
        out["lens"] += [len(s.response_ids) for s in samples]
        out["versions"] += [s.policy_version for s in samples]
        return free[len(groups) :]

    def apply_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self.engine.swap(state_dict, version)


def prompt_groups(samples: list[Sample], group_size: int) -> list[list[Sample]]:
    """Consecutive prompt groups of a rollout's samples (the n samples of a prompt are adjacent)."""
    return [samples[i : i + group_size] for i in range(0, len(samples), group_size)]


def complete_groups(keys: list[str], group_size: int) -> list[str]:
    """The keys whose whole prompt group is among ``keys`` (key = prompt position · n + sample index)."""
    count: dict[int, int] = {}
    for k in keys:
        count[int(k) // group_size] = count.get(int(k) // group_size, 0) + 1
    return [k for k in keys if count[int(k) // group_size] == group_size]


def _stream_stage(
    bus: DataBus,
    step: int,
    total: int,
    need: list[str],
    task: str,
    chunk: int,
    fn,
    whole_step: bool = False,
    group_size: int = 0,
) -> float:
    """Process every row of step ``step`` once: wait for rows with ``need``, ``fn(keys, rows)`` -> new
    fields, write them, mark the rows consumed by ``task``. ``group_size``: only whole prompt groups.
    Returns the seconds spent waiting."""
    part, done, waited = partition_name(step), 0, 0.0
    while done < total:
        t = time.perf_counter()
        keys = bus.wait_ready(part, need, task, min_count=(total - done) if whole_step else 1)
        keys = keys if whole_step else keys[:chunk]
        if group_size:
            keys = complete_groups(keys, group_size)
            if not keys:  # a group is still being written
                time.sleep(0.005)
                continue
        waited += time.perf_counter() - t
        fields = fn(keys, bus.get(part, keys, need))
        bus.put(part, keys, fields)
        bus.consume(part, keys, task)
        done += len(keys)
    return waited


class BusAdvantages(Advantages):
    def __init__(self, cfg, bus: DataBus, pad_token_id: int) -> None:
        super().__init__(cfg)
        torch.set_num_threads(1)  # tiny tensor ops; a thread pool per core would only contend with the roles
        self.cfg_all, self.bus, self.pad = cfg, bus, pad_token_id
        self.group_local = cfg.algorithm.advantage_estimator in GROUP_LOCAL_ESTIMATORS

    def process(self, step: int, total: int) -> dict[str, float]:
        inputs = advantage_inputs(self.cfg_all)

        def fn(keys, rows):
            batch = batch_from_rows(rows, self.pad, inputs)
            return {"advantages": per_sample(self.compute(batch), batch)}

        n = self.cfg_all.rollout.n_samples_per_prompt
        need = SAMPLE_FIELDS + inputs
        waited = _stream_stage(self.bus, step, total, need, "advantages", total, fn, not self.group_local, n)
        return {"time/advantages_wait_s": waited}


def _score_stage(role, step: int, total: int, task: str, field: str, chunk: int, score) -> dict[str, float]:
    """Stream step ``step``'s rows through ``score(batch) -> [B, R]`` into the per-token ``field``."""

    def fn(keys, rows):
        batch = batch_from_rows(rows, role.pad)
        return {field: per_sample(score(batch), batch)}

    return {f"time/{task}_wait_s": _stream_stage(role.bus, step, total, SAMPLE_FIELDS, task, chunk, fn)}


class BusReference(_WeightFollower, Reference):
    def __init__(self, cfg, model_path: str, bus: DataBus, pad_token_id: int) -> None:
        super().__init__(cfg, model_path)
        self.bus, self.pad, self.chunk = bus, pad_token_id, cfg.trainer.micro_batch_size

    def process(self, step: int, total: int) -> dict[str, float]:
        return _score_stage(
            self, step, total, "reference", "ref_logprobs", self.chunk, self.compute_ref_log_probs
        )

    def apply_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self.update_weights(state_dict)


class BusActorFwd(_WeightFollower, Actor):
    """ActorFwd: the behaviour policy's log-probs (version N−1) of step N, for the importance ratio."""

    def __init__(self, cfg, model_path: str, bus: DataBus, pad_token_id: int) -> None:
        super().__init__(cfg, model_path)
        self.bus, self.pad, self.chunk = bus, pad_token_id, cfg.trainer.micro_batch_size
        self.version = 0

    def process(self, step: int, total: int) -> dict[str, float]:
        return _score_stage(
            self, step, total, "actor_fwd", "old_logprobs", self.chunk, self.compute_log_probs
        )

    def apply_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self.backend.load_state_dict(state_dict)
        self.version = version


class BusTeacher(Teacher):
    """Teacher of on-policy distillation: frozen, writes ``teacher_logprobs`` for every row."""

    def __init__(self, cfg, teacher_path: str, bus: DataBus, pad_token_id: int) -> None:
        super().__init__(cfg, teacher_path)
        self.bus, self.pad = bus, pad_token_id

    def process(self, step: int, total: int) -> dict[str, float]:
        return _score_stage(
            self, step, total, "teacher", "teacher_logprobs", self.micro_batch_size, self.compute_log_probs
        )


class BusCritic(Critic):
    """Critic of PPO: writes ``values`` for every row of step N, then fits them on the whole step (the
    values of step N+1 therefore come from the critic trained on step N, as in colocate)."""

    def __init__(self, cfg, model_path: str, bus: DataBus, pad_token_id: int) -> None:
        super().__init__(cfg, model_path)
        self.bus, self.pad = bus, pad_token_id

    def process(self, step: int, total: int) -> dict[str, float]:
        metrics = _score_stage(
            self, step, total, "critic", "values", self.cfg.micro_batch_size, self.compute_values
        )
        keys = [sample_key(i) for i in range(total)]
        rows = self.bus.get(partition_name(step), keys, SAMPLE_FIELDS + ["values"])
        return metrics | self.fit(batch_from_rows(rows, self.pad, ["values"]))


class _MicroStream:
    """Stands in for a TrainBatch in ``backend.train_step``: yields micro-batches of one optimizer batch
    as soon as their rows have every field, and fixes the loss scale once the last one has gone through.

    Each micro-batch's loss carries the un-normalised weight (its tokens for token-mean, its sequences
    otherwise) because the batch total is unknown while it streams; after the last backward the gradients
    are divided by that total, which gives exactly the colocate gradient Σ_i (w_i / W) ∇ℓ_i.
    """

    def __init__(self, owner: BusActor, part: str, keys: list[str], need: list[str], extras: list[str]):
        self.owner, self.part, self.keys, self.need, self.extras = owner, part, keys, need, extras
        self.size = owner.cfg.trainer.micro_batch_size
        self.total_weight = 0.0
        self.wait_s = 0.0
        self.versions: list[int] = []

    def micro_batches(self, size: int) -> _MicroStream:
        self.size = size
        return self

    def __len__(self) -> int:
        return math.ceil(len(self.keys) / self.size)

    def __iter__(self):
        bus, remaining = self.owner.bus, list(self.keys)
        algo = self.owner.cfg.algorithm
        while remaining:
            want, pending = min(self.size, len(remaining)), set(remaining)
            t, delay = time.perf_counter(), 0.002
            while True:
                ready = [k for k in bus.ready(self.part, self.need) if k in pending]
                if len(ready) >= want:
                    break
                time.sleep(delay)
                delay = min(delay * 1.5, 0.05)
            self.wait_s += time.perf_counter() - t
            chosen = ready[:want]
            remaining = [k for k in remaining if k not in set(chosen)]
            micro = batch_from_rows(bus.get(self.part, chosen, self.need), self.owner.pad, self.extras)
            self.total_weight += micro_batch_weight(micro, 1.0, 1, algo)
            self.versions += micro.policy_versions.tolist()
            yield micro
        scale = 1.0 / max(self.total_weight, 1.0)  # the denominator colocate's micro_batch_weight uses
        for p in self.owner.backend.model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)


class BusActor(Actor):
    """The Actor of async mode: trains step N from the bus, then keeps a snapshot of version N to publish."""

    def __init__(self, cfg, model_path: str, bus: DataBus, pad_token_id: int) -> None:
        super().__init__(cfg, model_path)
        self.bus, self.pad = bus, pad_token_id
        self._ws: dict[str, WeightSyncGroup] = {}
        self._snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self._snap_lock = threading.Lock()

    # weight sync (rank 0)
    def ws_address(self) -> tuple[str, int]:
        return free_port()

    def ws_layout(self) -> list:
        return layout_of(self.backend.state_dict())

    def ws_join(self, spec: SyncSpec, rank: int) -> None:
        self._ws[spec.name] = WeightSyncGroup(spec, rank)

    def ws_snapshot(self, version: int) -> None:
        with self._snap_lock:
            self._snapshots[version] = self.backend.state_dict()

    def ws_publish(self, names: list[str], version: int) -> float:
        """Broadcast snapshot ``version`` to the groups ``names`` (runs beside the next training step)."""
        t = time.perf_counter()
        with self._snap_lock:
            state = self._snapshots.pop(version)
        for name in names:
            self._ws[name].send(state)
        return time.perf_counter() - t

    def train_from_bus(self, step: int, total: int, need: list[str], extras: list[str]) -> dict[str, float]:
        """``ppo_epochs`` passes over step ``step``'s rows, one optimizer step per global batch."""
        algo, trainer = self.cfg.algorithm, self.cfg.trainer
        if critic_warming_up(algo, step):  # PPO: the policy waits for the critic, version ``step`` = step−1
            self.ws_snapshot(step)
            return FROZEN_ACTOR_METRICS | {"optimizer_steps": 0.0} | staleness_metrics([], step - 1)
        global_size = trainer.global_batch_size or total
        keys = [sample_key(i) for i in range(total)]
        part = partition_name(step)
        sums: dict[str, float] = {}
        updates, wait_s, versions = 0, 0.0, []
        t0 = time.perf_counter()
        for epoch in range(algo.ppo_epochs):
            for start in range(0, total, global_size):
                stream = _MicroStream(self, part, keys[start : start + global_size], need, extras)

                def loss_fn(micro, logprobs, entropy):
                    loss, m = policy_objective(
                        micro, logprobs, entropy, algo, micro_batch_weight(micro, 1.0, 1, algo)
                    )
                    mask, lp = micro.loss_mask, logprobs.detach()
                    m["off_policy/train_rollout_abs_diff"] = float(
                        masked_mean((lp - micro.rollout_logprobs).abs(), mask)
                    )
                    if "old_logprobs" in micro.extras:
                        m["off_policy/old_rollout_abs_diff"] = float(
                            masked_mean((micro.extras["old_logprobs"] - micro.rollout_logprobs).abs(), mask)
                        )
                    return loss, m

                out = self.backend.train_step(stream, loss_fn, trainer.micro_batch_size)
                out["loss"] = out["loss"] / max(stream.total_weight, 1.0)
                for k, v in out.items():
                    sums[k] = sums.get(k, 0.0) + v
                updates += 1
                wait_s += stream.wait_s
                if epoch == 0:
                    versions += stream.versions
        self.bus.consume(part, keys, "actor")
        self.ws_snapshot(step)
        metrics = {k: v / updates for k, v in sums.items()} | {"optimizer_steps": float(updates)}
        metrics |= staleness_metrics(versions, step - 1)
        metrics["time/actor_data_wait_s"] = wait_s
        metrics["time/actor_busy_s"] = time.perf_counter() - t0 - wait_s
        return metrics


# ---------------------------------------------------------------------------------------- the scheduler
class AsyncLoop:
    """Builds the role groups of ``mode=async`` and schedules them; the Controller supplies the rest."""

    def __init__(self, controller) -> None:
        self.c = controller
        cfg = self.cfg = controller.cfg
        r, a = cfg.rollout, cfg.algorithm
        self.gate = StalenessGate(cfg.mode.max_staleness)
        self.step_samples = r.batch_size * r.n_samples_per_prompt
        self.use_fwd = uses_actor_fwd(cfg)
        self.use_ref = controller.use_reference
        self.use_critic, self.use_teacher = a.critic is not None, a.teacher is not None
        # dynamic sampling: up to max_gen_batches rollout rounds per step until its group slots are full
        self.max_rounds = a.max_gen_batches if a.dynamic_sampling else 1
        self.ref_every = cfg.mode.ref_update_interval if self.use_ref else 0
        self.pgs: list = []
        self.groups: dict[str, RoleGroup] = {}
        self.bus: DataBus | None = None
        self.bus_stats = {"put_samples": 0, "put_s": 0.0}
        self.last_sync_s = 0.0

    # ------------------------------------------------------------------ setup / teardown
    def _group(self, cls, name: str, replicas: int, cpus: float, gpus: float, args: tuple, **kw) -> RoleGroup:
        bundle = {"CPU": cpus} | ({"GPU": gpus} if gpus else {})
        pg = placement_group([bundle] * replicas, strategy="PACK", name=f"relax-{name}")
        self.pgs.append(pg)
        ray.get(pg.ready(), timeout=120)
        group = RoleGroup(cls, name, replicas, pg, list(range(replicas)), cpus, gpus, args, **kw)
        self.groups[name] = group
        return group

    def _check_resources(self) -> None:
        r, t, m = self.cfg.rollout, self.cfg.trainer, self.cfg.mode
        helpers = 1 + self.use_fwd + self.use_ref + self.use_critic + self.use_teacher
        need = r.num_cpus * r.num_engines + t.num_cpus + m.aux_num_cpus * helpers
        need += BUS_CPUS + (2.0 if m.databus == "transferqueue" else 0.0)
        have = ray.cluster_resources().get("CPU", 0.0)
        if need > have + 1e-9:
            raise RelaxUserError(
                f"mode=async needs {need:g} logical CPUs in Ray (rollout {r.num_cpus}x{r.num_engines}, actor "
                f"{t.num_cpus}, helpers {m.aux_num_cpus} each{', TransferQueue 2' if m.databus == 'transferqueue' else ''}) "
                f"but the cluster has {have:g}: raise cluster.num_cpus or lower rollout.num_cpus/trainer.num_cpus/mode.aux_num_cpus"
            )

    def start_roles(self) -> None:
        cfg, r, t, m = self.cfg, self.cfg.rollout, self.cfg.trainer, self.cfg.mode
        self._check_resources()
        t0 = time.perf_counter()
        self.bus = start_databus(m.databus)
        self.bus_init_s = time.perf_counter() - t0
        pad = self.c.tokenizer.pad_token_id
        path = self.c.model_path
        rollout = self._group(
            BusRollout,
            "rollout",
            r.num_engines,
            r.num_cpus,
            r.num_gpus,
            (cfg, path, self.bus),
            pass_replica=True,
        )
        actor = self._group(BusActor, "actor", 1, t.num_cpus, t.num_gpus, (cfg, path, self.bus, pad))
        aux_gpu = t.num_gpus
        self._group(BusAdvantages, "advantages", 1, min(m.aux_num_cpus, 0.05), 0.0, (cfg, self.bus, pad))
        if self.use_fwd:
            self._group(BusActorFwd, "actor_fwd", 1, m.aux_num_cpus, aux_gpu, (cfg, path, self.bus, pad))
        if self.use_ref:
            self._group(BusReference, "reference", 1, m.aux_num_cpus, aux_gpu, (cfg, path, self.bus, pad))
        if self.use_critic:
            self._group(BusCritic, "critic", 1, m.aux_num_cpus, aux_gpu, (cfg, path, self.bus, pad))
        if self.use_teacher:
            teacher = (cfg, self.c.algo_roles.teacher_path, self.bus, pad)
            self._group(BusTeacher, "teacher", 1, m.aux_num_cpus, aux_gpu, teacher)
        # the Controller's shared pieces (warm start, evaluation) talk to these groups; the warm start
        # loads the Critic's trunk from the policy through AlgorithmRoles, as in colocate
        self.c.rollout, self.c.actor = rollout, actor
        self.c.algo_roles.critic = self.groups.get("critic")
        self._join_weight_sync()
        log.info(
            "async roles up: %s | databus=%s (%.1f s) | max_staleness=%d | ActorFwd %s",
            ", ".join(f"{k}x{len(g)}" for k, g in self.groups.items()),
            m.databus,
            self.bus_init_s,
            m.max_staleness,
            "on" if self.use_fwd else "off (one optimizer batch per rollout batch)",
        )

    def _join_weight_sync(self) -> None:
        m = self.cfg.mode
        actor = self.groups["actor"].actors[0]
        layout = ray.get(actor.ws_layout.remote())
        backend = "nccl" if self.cfg.trainer.num_gpus and torch.cuda.is_available() else "gloo"
        followers = list(self.groups["rollout"].actors)
        if self.use_fwd:
            followers += self.groups["actor_fwd"].actors
        self.sync_groups = {"policy": followers}
        if self.ref_every:
            self.sync_groups["reference"] = list(self.groups["reference"].actors)
        for name, members in self.sync_groups.items():
            host, port = ray.get(actor.ws_address.remote())
            spec = SyncSpec(name, host, port, len(members) + 1, layout, m.weight_sync_bucket_mb, backend)
            refs = [actor.ws_join.remote(spec, 0)]
            refs += [f.ws_join.remote(spec, i + 1) for i, f in enumerate(members)]
            ray.get(refs, timeout=spec.timeout_s)

    def stop(self) -> None:
        for group in self.groups.values():
            try:
                group.kill()
            except Exception:  # noqa: BLE001  (best effort while tearing down)
                pass
        self.groups.clear()
        # killed above; the Controller must not kill them again
        self.c.rollout = self.c.actor = self.c.algo_roles.critic = None
        for pg in self.pgs:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001
                pass
        self.pgs.clear()
        if self.bus is not None:
            try:
                self.bus.close()
            except Exception:  # noqa: BLE001
                pass
            self.bus = None

    # ------------------------------------------------------------------ weights
    def _publish(self, version: int, blocking: bool = False) -> list[ray.ObjectRef]:
        """Broadcast snapshot ``version`` to the policy followers (and the Reference when due)."""
        actor = self.groups["actor"].actors[0]
        names = ["policy"] + (
            ["reference"] if self.ref_every and version and version % self.ref_every == 0 else []
        )
        refs = [actor.ws_publish.remote(names, version)]
        for name in names:
            refs += [f.ws_receive.remote(name, version) for f in self.sync_groups[name]]
        if blocking:
            ray.get(refs)
        return refs

    def push_weights(self, version: int) -> None:
        """Blocking publish (after the warm start): snapshot and broadcast ``version``; the frozen
        Reference starts from the warm-started policy too, as in colocate."""
        actor = self.groups["actor"].actors[0]
        ray.get(actor.ws_snapshot.remote(version))
        self._publish(version, blocking=True)
        if self.use_ref:
            ray.get(self.groups["reference"].actors[0].update_weights.remote(actor.state_dict.remote()))

    # ------------------------------------------------------------------ the loop
    def _launch_round(self, step: int, roll: dict[str, Any]) -> list[ray.ObjectRef]:
        """One rollout round of ``step``: a batch of prompts over the engines, each filling its share of
        the step's free group slots."""
        engines = self.groups["rollout"].actors
        k = min(len(engines), len(roll["free"]))
        prompts = self.c.stream.next_batch(self.cfg.rollout.batch_size)
        roll["round"] += 1
        last = roll["round"] >= self.max_rounds
        return [
            engine.produce.remote(step, chunk, slots, last)
            for engine, chunk, slots in zip(
                engines, split_evenly(prompts, k), split_evenly(roll["free"], k), strict=False
            )
        ]

    def steps(self):
        """Run ``trainer.total_steps`` RL steps; yield ``(step, metrics)`` in step order."""
        cfg, c = self.cfg, self.c
        total = cfg.trainer.total_steps
        actor = self.groups["actor"].actors[0]
        extras = ["advantages"] + ["ref_logprobs"] * self.use_ref + ["old_logprobs"] * self.use_fwd
        need = list(SAMPLE_FIELDS) + extras
        stages = [name for name in HELPER_STAGES if name in self.groups]
        trained, next_roll, synced = 0, 1, 0
        kinds: dict[ray.ObjectRef, tuple[str, int]] = {}
        roll: dict[str, Any] = {}  # the step being generated: free slots, rounds, pending refs, results
        stage_busy: dict[str, int | None] = dict.fromkeys(stages)
        stage_next: dict[str, int] = dict.fromkeys(stages, 1)
        rolling: int | None = None
        training: int | None = None
        sync_queue: deque[int] = deque()
        sync_inflight: tuple[int, list] | None = None
        info: dict[int, dict[str, Any]] = {}
        evals_due: set[int] = set()
        yielded, last_done = 0, time.perf_counter()

        def launch(ref, kind, step):
            kinds[ref] = (kind, step)

        def launch_round(s):
            refs = self._launch_round(s, roll)
            roll["pending"] = set(refs)
            for ref in refs:
                launch(ref, "rollout", s)

        while yielded < total:
            # 1. weights: one version at a time, in order
            if sync_inflight is None and sync_queue:
                v = sync_queue.popleft()
                refs = self._publish(v)
                sync_inflight = (v, refs)
                for ref in refs:
                    launch(ref, "sync", v)
            # 2. evaluation of a finished step on its own weights, when rollout is idle
            for s in sorted(evals_due):
                if rolling is None and synced >= s:
                    info[s]["eval"] = c.evaluate()
                    evals_due.discard(s)
            # 3. rollout of the next step, if the staleness gate and the engines' weights allow it
            if (
                rolling is None
                and not evals_due
                and next_roll <= total
                and self.gate.may_start(next_roll, trained + 1)
                and synced >= self.gate.min_weight_version(next_roll)
            ):
                s = next_roll
                roll = {"free": list(range(cfg.rollout.batch_size)), "round": 0, "parts": []}
                roll["launched"] = time.perf_counter()
                info[s] = {"stages": {}, "eval": {}}
                launch_round(s)
                rolling, next_roll = s, s + 1
            # 4. helper stages follow the rollout step by step
            for name in stages:
                s = stage_next[name]
                if stage_busy[name] is not None or s >= next_roll:
                    continue
                if name == "actor_fwd" and synced < s - 1:  # behaviour policy = version s-1
                    continue
                launch(self.groups[name].actors[0].process.remote(s, self.step_samples), name, s)
                stage_busy[name], stage_next[name] = s, s + 1
            # 5. the Actor trains the oldest unconsumed step as its rows stream in
            if training is None and trained < total and trained + 1 < next_roll:
                s = trained + 1
                launch(actor.train_from_bus.remote(s, self.step_samples, need, extras), "train", s)
                training = s
                info[s]["train_launch"] = time.perf_counter()
            # 6. wait for anything to finish
            done, _ = ray.wait(list(kinds), num_returns=1, timeout=1.0)
            for ref in done:
                kind, s = kinds.pop(ref)
                value = ray.get(ref)  # re-raises a role's error here
                if kind == "rollout":
                    roll["pending"].discard(ref)
                    roll["parts"].append(value)
                    filled = set(value["filled"])
                    roll["free"] = [g for g in roll["free"] if g not in filled]
                    if roll["pending"]:
                        continue
                    if roll["free"]:  # dynamic sampling: another round for the groups still missing
                        launch_round(s)
                        continue
                    info[s] |= {"rollout": roll["parts"], "rounds": roll["round"]}
                    info[s]["rollout_s"] = time.perf_counter() - roll["launched"]
                    rolling = None
                elif kind in stage_busy:
                    stage_busy[kind] = None
                    info[s]["stages"] |= value
                elif kind == "train":
                    training, trained = None, s
                    info[s]["train"] = value
                    info[s]["train_s"] = time.perf_counter() - info[s]["train_launch"]
                    sync_queue.append(s)
                    if cfg.trainer.eval_every and (s % cfg.trainer.eval_every == 0 or s == total):
                        evals_due.add(s)
                elif kind == "sync":
                    v, refs = sync_inflight
                    if ref is refs[0] or ref == refs[0]:
                        self.last_sync_s = value  # the Actor's broadcast time of version v
                    if all(x not in kinds for x in refs):
                        synced, sync_inflight = v, None
            # 7. hand out finished steps in order, once rollout, Actor and every helper are done with them
            while yielded < total and {"rollout", "train"} <= set(info.get(yielded + 1, ())):
                s = yielded + 1
                if s in evals_due or any(stage_busy[n] == s or stage_next[n] <= s for n in stages):
                    break
                self.bus.clear(partition_name(s))
                now, step_info = time.perf_counter(), info.pop(s)
                step_info["step_time_s"], last_done = now - last_done, now
                yield s, self._step_metrics(step_info) | step_info["stages"] | step_info["eval"]
                yielded = s

    def _step_metrics(self, info: dict[str, Any]) -> dict[str, float]:
        parts = info["rollout"]
        samples = [
            Sample(0, 0, [], [], [], [], reward=rw, reward_extras=ex)
            for p in parts
            for rw, ex in zip(p["rewards"], p["extras"], strict=True)
        ]
        train = info["train"]
        tokens = sum(sum(p["lens"]) for p in parts)
        put_s = sum(p["put_s"] for p in parts)
        self.bus_stats["put_samples"] += len(samples)
        self.bus_stats["put_s"] += put_s
        metrics = reward_metrics(samples) | train
        metrics.update(
            {
                "kl": train.get("kl", 0.0),
                "step_time_s": info["step_time_s"],
                "tokens_per_s": tokens / max(info["step_time_s"], 1e-9),
                "response_length": tokens / max(len(samples), 1),
                "time/rollout_s": info["rollout_s"],
                "time/train_s": info["train_s"],
                "time/bus_put_s": put_s,
                "rollout/resumed": float(sum(p["resumed"] for p in parts)),
                "time/weight_sync_s": self.last_sync_s,
            }
        )
        if self.cfg.algorithm.dynamic_sampling:
            metrics |= dynamic_sampling_metrics(
                info["rounds"],
                sum(p["kept_groups"] for p in parts),
                sum(p["generated_groups"] for p in parts),
                [rw for p in parts for rw in p["generated_rewards"]],
            )
        return metrics


def validate_async(cfg) -> None:
    """Rules of ``mode=async`` that types cannot express (called from :func:`relax_core.validation.validate`)."""
    from relax_core.databus import DATABUS_CHOICES

    m = cfg.mode
    if m.databus not in DATABUS_CHOICES[:2]:
        raise RelaxUserError(f"mode.databus={m.databus!r} is not one of {DATABUS_CHOICES[:2]}")
    if m.partial_rollout not in ("finish", "abort"):
        raise RelaxUserError(f"mode.partial_rollout={m.partial_rollout!r} is not one of ['finish', 'abort']")
    if m.rollout_chunk_prompts < 0:
        raise RelaxUserError(f"mode.rollout_chunk_prompts must be >= 0, got {m.rollout_chunk_prompts}")
    if m.weight_sync_bucket_mb <= 0:
        raise RelaxUserError(f"mode.weight_sync_bucket_mb must be > 0, got {m.weight_sync_bucket_mb}")
    if m.ref_update_interval < 0:
        raise RelaxUserError(f"mode.ref_update_interval must be >= 0, got {m.ref_update_interval}")
    if cfg.trainer.resume:
        raise RelaxUserError(
            "trainer.resume is not supported with mode=async yet (resume with mode=colocate)"
        )
    if cfg.trainer.save_every:
        raise RelaxUserError(
            "trainer.save_every: checkpoints of mode=async (in-flight steps on the bus) are not supported yet"
        )
    if cfg.trainer.backend != "torch":
        raise RelaxUserError(
            f"mode=async supports trainer.backend=torch for now, got {cfg.trainer.backend!r}"
        )
    if m.aux_num_cpus <= 0:
        raise RelaxUserError(f"mode.aux_num_cpus must be > 0, got {m.aux_num_cpus}")
