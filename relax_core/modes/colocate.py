"""``mode=colocate``: every role in one placement group, taking turns; strictly on-policy.

One RL step, top to bottom: collect (Rollout: generate + reward; DAPO dynamic sampling) -> annotate
(Reference / ActorFwd / Critic / Teacher per-token scores) -> Advantages -> update (Critic, then Actor) ->
publish the new weights to the rollout engines.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from relax_core.algorithms.sampling_rules import collect_with_dynamic_sampling
from relax_core.algorithms.spec import needs_old_logprobs
from relax_core.engines import ENGINES
from relax_core.engines.base import SamplingParams
from relax_core.modes.base import Mode, RoleGroups, StepMetrics, reward_metrics
from relax_core.roles.actor import Actor
from relax_core.roles.advantages import Advantages
from relax_core.roles.critic import Critic
from relax_core.roles.reference import Reference
from relax_core.roles.teacher import Teacher
from relax_core.rollout.pool import RolloutPool
from relax_core.runtime import handles
from relax_core.runtime.groups import RoleGroup, SharedProcesses
from relax_core.runtime.placement import (
    actor_world_size,
    bundle_nodes,
    colocate_bundles,
    helper_ranks,
    rank_envs,
    reserve,
)
from relax_core.samples import PromptRecord, Sample, TrainBatch
from relax_core.weight_transfer import WeightTransfer

log = logging.getLogger("relax")


class ColocateMode(Mode):
    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.advantages = Advantages(ctx.cfg)  # tensor math on the driver: no actor of its own
        self.step_extra: StepMetrics = {}
        self.pg = None
        self.engines_released = False  # rollout.release_memory_during_train: engines freed their KV cache
        self.agent = None  # rollout.agent: an external program plays the episodes through the endpoint

    # ------------------------------------------------------------------ roles
    def start(self) -> RoleGroups:
        cfg, needs = self.cfg, self.ctx.needs
        r, t = cfg.rollout, cfg.trainer
        self.start_judge()
        # bundle i: rollout engine i (i < num_engines), actor rank i (i < world); bundle 0 also holds the
        # Reference, Critic and Teacher, unless FSDP shards them over ranks like the Actor's: then rank i of
        # each sits next to Actor rank i. They take turns with the Actor, so the model roles next to one
        # Actor rank split its trainer.num_cpus/num_gpus instead of reserving their own
        world = actor_world_size(t)
        sharded = set(needs.model_roles) if helper_ranks(t) > 1 else set()
        bundles = colocate_bundles(r, t)
        # cluster=in_process: no Ray, every role an object in this process (relax_core/runtime/handles.py)
        self.pg = None if cfg.cluster.name == "in_process" else reserve(bundles, "relax-colocate")
        shared = SharedProcesses(self.pg, "actor-rollout", ["actor", "rollout"]) if self._fuse() else None
        actor_args = (cfg, self.ctx.model_path)
        self.roles.actor = self._ranks(Actor, "actor", actor_args, world, pass_replica=True, shared=shared)
        # launch engines + elastic members (scale-out/in, external URLs) behind a router
        pool = RolloutPool(cfg, self.ctx.model_path, self.pg, list(range(r.num_engines)), shared)
        self.roles.rollout = pool
        helper_roles = {
            "reference": (Reference, self.ctx.model_path),
            "critic": (Critic, self.ctx.model_path),
            "teacher": (Teacher, self.ctx.teacher_path),
        }
        for name in needs.model_roles:
            role, path = helper_roles[name]
            setattr(self.roles, name, self._helper_group(role, name, path, name in sharded, world))
        if world > 1 and self.pg is not None:  # where Ray put rank i (bundle i): nodes may differ
            log.info("actor ranks on nodes: %s", ", ".join(bundle_nodes(self.pg)[:world]))
        # weight_transfer=auto: each engine's channel reaches where it runs (the Actor's process, node, or not)
        self.transfer = WeightTransfer(
            cfg.weight_transfer.name,
            self.roles.actor,
            cfg.weight_transfer,
            cfg.output_dir,
            self.ctx.model_path,
        )
        self.transfer.connect("policy", list(pool.actors))
        pool.attach(self.transfer)
        if r.agent is not None:  # the OpenAI-compatible endpoint over the pool, and the program's copies
            from relax_core.agentic.programs import AgentProgramRollout

            self.agent = AgentProgramRollout(cfg, pool, self.ctx.tokenizer)
            self.agent.start()
        log.info(
            "colocate roles up | weight transfer: %s | actor+rollout fused: %s | FSDP-sharded helpers: %s",
            self.transfer.describe(),
            bool(shared),
            ", ".join(sorted(sharded)) or "none",
        )
        return self.roles

    def _helper_group(self, role: type, name: str, model_path: str, sharded: bool, world: int) -> RoleGroup:
        """A Reference, Critic or Teacher: one process in bundle 0, or (``sharded``) ``world`` FSDP ranks in a
        process group of their own, rank i in bundle i next to Actor rank i."""
        args = (self.cfg, model_path)
        if not sharded:
            return self._ranks(role, name, args, 1)
        return self._ranks(role, name, args, world, kwargs={"sharded": True})

    def _ranks(self, role: type, name: str, args: tuple, world: int, **options: Any) -> RoleGroup:
        """``world`` processes of ``role`` in bundles 0..world-1; several form one gloo/NCCL group, on
        one node or several (FSDP data-parallel or megatron model-parallel ranks)."""
        t = self.cfg.trainer
        return RoleGroup(
            role,
            name,
            world,
            self.pg,
            list(range(world)),
            self._share(t.num_cpus),
            self._share(t.num_gpus),
            args,
            env_vars=rank_envs(world),
            **options,
        )

    def _share(self, amount: float) -> float:
        """One model role's part of an Actor rank's ``amount``, rounded down to Ray's resource precision
        (1e-4) so that the parts never add up to more than the bundle holds."""
        parts = 1 + len(self.ctx.needs.model_roles)
        return math.floor(amount / parts * 1e4) / 1e4

    def _fuse(self) -> bool:
        """Whether the Actor and the rollout engine share one process (``mode.fuse_rollout``)."""
        r, t = self.cfg.rollout, self.cfg.trainer
        return (
            self.cfg.mode.fuse_rollout
            and self.pg is not None  # in_process: every role shares this process already
            and actor_world_size(t) == 1
            and r.num_engines == 1
            and r.engine == "torch"
            and r.num_gpus == 0
            and t.num_gpus == 0
            and r.num_threads == t.num_threads
        )

    def stop(self) -> None:
        if self.agent is not None:
            self.agent.stop()
        for group in self.roles.all().values():
            group.kill()
        self.roles = RoleGroups()
        if self.transfer is not None:
            self.transfer.close()
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group  # Ray runs: the group is Ray's

            remove_placement_group(self.pg)
            self.pg = None
        self.stop_judge()

    def replaced(self, role: str, index: int, handle: Any) -> None:
        super().replaced(role, index, handle)
        if role == "rollout":  # the new engine serves the current policy
            self.transfer.replace("policy", index, handle)
            handles.get(self.transfer.deliver(handle))

    # ------------------------------------------------------------------ weights and generation
    def publish(self, version: int) -> None:
        self.roles.rollout.push_weights(version)

    def engine_memory(self, release: bool) -> None:
        """``rollout.release_memory_during_train``: the engines free their KV cache (``release``) or take it
        back; each only once."""
        if self.engines_released != release:
            pool = self.roles.rollout
            pool.release_memory() if release else pool.resume_memory()
            self.engines_released = release

    def generate(
        self, prompts: list[PromptRecord], greedy: bool = False, sampling: SamplingParams | None = None
    ) -> list[Sample]:
        self.engine_memory(release=False)  # e.g. an evaluation after a step that failed while released
        if self.agent is not None:  # the agent program plays them through the endpoint (greedy or not)
            return self.agent.generate(prompts, greedy)
        return self.roles.rollout.generate(prompts, greedy, sampling)

    # ------------------------------------------------------------------ one step
    def collect(self) -> list[Sample]:
        """Stage 1 — Rollout: one step's prompts, sampled and scored (DAPO: shaped, dynamically sampled)."""
        r = self.cfg.rollout
        samples, self.step_extra = collect_with_dynamic_sampling(
            lambda: self.generate(self.ctx.stream.next_batch(r.batch_size)),
            self.cfg.algorithm,
            r.batch_size,
            r.max_new_tokens,
        )
        return samples

    def annotate(self, batch: TrainBatch) -> None:
        """Stage 2 — per-token scores other roles add: ref log-probs (KL), behaviour log-probs (ActorFwd),
        values (Critic), teacher log-probs (Teacher)."""
        roles = self.roles
        if roles.reference is not None:
            batch.extras["ref_logprobs"] = roles.reference.call_collective("compute_log_probs", batch)
        if needs_old_logprobs(self.cfg, len(batch)):
            # several updates per batch: the first one's log-probs are the behaviour policy's (ActorFwd)
            batch.extras["old_logprobs"] = roles.actor.call_collective("compute_log_probs", batch)
        refs = {}  # Critic and Teacher score at once; every rank of a sharded Critic is awaited
        if roles.critic is not None:
            refs["values"] = roles.critic.call("compute_values", batch)
        if roles.teacher is not None:
            refs["teacher_logprobs"] = roles.teacher.call("compute_log_probs", batch)
        for key, per_rank in refs.items():
            batch.extras[key] = handles.get(per_rank)[0]

    def update(self, step: int, batch: TrainBatch) -> StepMetrics:
        """Stage 4 — Critic on the GAE returns (PPO), then the Actor's optimizer step(s) (none during the
        critic's warm-up)."""
        metrics: StepMetrics = {}
        if self.roles.critic is not None:
            metrics = self.roles.critic.call_collective("fit", batch)
        return metrics | self.roles.actor.call_collective("train", step, batch)

    def train_step(self, step: int) -> StepMetrics:
        """collect -> annotate -> advantages -> update -> weights to rollout, timing each stage."""
        times: dict[str, float] = {}

        def timed(name: str, fn, *args):
            t = time.perf_counter()
            result = fn(*args)
            times[f"time/{name}_s"] = time.perf_counter() - t
            return result

        t0 = time.perf_counter()
        offload = self.cfg.trainer.offload  # the Actor leaves the device to the engines while they generate
        if offload:
            timed("offload", self.roles.actor.call_collective, "offload")
        samples = timed("rollout", self.collect)
        release = self.cfg.rollout.release_memory_during_train
        # the engines' KV cache makes room for the trainer (before the Actor is back on the device)
        if release:
            timed("release_memory", self.engine_memory, True)
        if offload:
            timed("onload", self.roles.actor.call_collective, "onload")
        batch = TrainBatch.from_samples(samples, self.ctx.tokenizer.pad_token_id)
        timed("logprob", self.annotate, batch)
        batch.extras["advantages"] = timed("advantages", self.advantages.compute, batch)
        train_metrics = timed("train", self.update, step, batch)
        if release:  # weights land in an awake engine
            timed("resume_memory", self.engine_memory, False)
        timed("weight_sync", self.health.retrying, lambda: self.publish(step), f"weight sync v{step}")
        step_time = time.perf_counter() - t0

        response_tokens = int(batch.response_lens.sum())
        metrics = reward_metrics(samples) | train_metrics | times | self.step_extra
        metrics.update(
            kl=train_metrics.get("kl", 0.0),
            step_time_s=step_time,
            tokens_per_s=response_tokens / step_time,
            response_length=response_tokens / len(samples),
            **{"staleness/mean": 0.0, "staleness/max": 0.0},
        )
        metrics["weights/bytes"] = float(self.transfer.stats.bytes)
        metrics |= self.engine_sync_metrics()
        metrics |= self.roles.rollout.step_metrics()  # samples and engines behind this step (elastic scaling)
        if self.agent is not None:
            metrics |= self.agent.metrics()
        return metrics

    def engine_sync_metrics(self) -> dict[str, float]:
        """What the step's weight update moved into each engine server (``weight_sync/bytes``, ``/seconds``,
        ``/adapter_only``; LoRA adapter sync moves the adapters alone), the mean over the launch engines; none
        for engines that load in the Rollout's process."""
        if not ENGINES.load(self.cfg.rollout.engine).copies_weights:
            return {}
        stats = [s for s in handles.get(self.roles.rollout.call("sync_metrics")) if s]
        return {k: sum(s[k] for s in stats) / len(stats) for k in stats[0]} if stats else {}

    def steps(self, first: int, evaluate: Callable[[int], StepMetrics]) -> Iterator[tuple[int, StepMetrics]]:
        for step in range(first, self.cfg.trainer.total_steps + 1):
            yield step, self.health.run_step(step, self.train_step, self.ctx.stream)
