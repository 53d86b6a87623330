"""The controller: builds the role groups from the config and runs the training loop of the mode.

Read top to bottom this is one RL step: prompts -> Rollout (generate + reward) -> Reference (ref
log-probs, when a KL term is on) -> Advantages -> Actor (optimizer step) -> weights to the rollout engines.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group

from relax_core.algorithm_roles import AlgorithmRoles, needs_reference
from relax_core.checkpoint import (
    STOP_REQUEST,
    CheckpointManager,
    checkpoint_root,
    resolve_resume,
    restore_run,
    save_run,
)
from relax_core.data import PromptStream, dataset_paths, load_prompts
from relax_core.health import GlobalRestartNeeded, HealthManager
from relax_core.metrics import MetricsSink, format_step_line
from relax_core.multimodal import MediaPrompts
from relax_core.placement import actor_world_size, rank_env
from relax_core.ray_groups import RoleGroup
from relax_core.roles.actor import Actor
from relax_core.roles.advantages import Advantages
from relax_core.roles.reference import Reference
from relax_core.rollout_pool import RolloutPool
from relax_core.samples import PromptRecord, Sample, TrainBatch
from relax_models.loader import load_tokenizer, resolve_model_path
from relax_models.megatron.cpu_shim import free_port

log = logging.getLogger("relax")


def split_evenly(items: list, parts: int) -> list[list]:
    """``items`` in ``parts`` contiguous chunks whose sizes differ by at most one."""
    size, extra = divmod(len(items), parts)
    chunks, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        chunks.append(items[start:end])
        start = end
    return chunks


def reward_metrics(samples: list[Sample], prefix: str = "reward") -> dict[str, float]:
    rewards = torch.tensor([s.reward for s in samples])
    out = {f"{prefix}/mean": float(rewards.mean()), f"{prefix}/std": float(rewards.std(unbiased=False))}
    extra_keys = {k for s in samples for k in s.reward_extras}
    for key in sorted(extra_keys):
        out[f"{prefix}/{key}"] = sum(s.reward_extras.get(key, 0.0) for s in samples) / len(samples)
    return out


def accuracy(samples: list[Sample]) -> float:
    """Share of exactly solved prompts: the reward's ``acc`` entry when it has one, else reward ≥ 1."""
    solved = [s.reward_extras["acc"] if "acc" in s.reward_extras else float(s.reward >= 1.0) for s in samples]
    return sum(solved) / max(len(solved), 1)


class Controller:
    def __init__(self, cfg, resolved: dict[str, Any]) -> None:
        self.cfg = cfg
        self.resolved = resolved
        self.model_path = resolve_model_path(cfg.model, cfg.output_dir, cfg.seed)
        self.tokenizer = load_tokenizer(self.model_path)
        if cfg.rollout.env is not None or cfg.rollout.agent is not None:
            import relax_core.agentic  # noqa: F401  (registers the agentic synthetic tasks)
        train_path, eval_path = dataset_paths(cfg.data, cfg.output_dir, cfg.seed)
        # multimodal runs (modality.keys): the processor reads media columns; None for text
        self.media = MediaPrompts.from_config(cfg.modality, self.model_path)
        train, self.skipped_rows = load_prompts(train_path, cfg.data, self.tokenizer, self.media)
        self.eval_prompts = (
            load_prompts(eval_path, cfg.data, self.tokenizer, self.media)[0] if eval_path else []
        )
        self.stream = PromptStream(train, cfg.seed, cfg.data.shuffle)
        self.advantages = Advantages(cfg)
        self.use_reference = needs_reference(cfg.algorithm)
        # Critic/Teacher groups and DAPO sampling (trains the default opd teacher once if missing)
        self.algo_roles = AlgorithmRoles(cfg, self.model_path)
        self.sink: MetricsSink | None = None
        self.pg = None
        self.agent = None  # rollout.agent: an external program plays the episodes

    # ---------------------------------------------------------------- role groups
    def start_roles(self) -> None:
        """Colocate: every role shares each bundle of one placement group and they take turns."""
        if self.cfg.mode.name == "async":  # every role its own placement group: relax_core/async_loop.py
            from relax_core.async_loop import AsyncLoop

            self.async_loop = AsyncLoop(self)
            return self.async_loop.start_roles()
        r, t = self.cfg.rollout, self.cfg.trainer
        # bundle i: rollout engine i (i < num_engines), actor rank i (i < world), reference in bundle 0
        world = actor_world_size(t)
        bundles = []
        for i in range(max(r.num_engines, world)):
            engines, trainers = int(i < r.num_engines), int(i < world) + int(i == 0 and self.use_reference)
            trainers += self.algo_roles.extra_trainers if i == 0 else 0  # Critic, Teacher
            gpu = engines * r.num_gpus + trainers * t.num_gpus
            bundles.append(
                {"CPU": engines * r.num_cpus + trainers * t.num_cpus} | ({"GPU": gpu} if gpu else {})
            )
        self.pg = placement_group(bundles, strategy="PACK")
        ray.get(self.pg.ready(), timeout=120)
        args = (self.cfg, self.model_path)
        # launch engines + elastic members (scale-out/in, external URLs) behind a router
        self.rollout = RolloutPool(self.cfg, self.model_path, self.pg, list(range(r.num_engines)))
        if r.agent is not None:  # the OpenAI-compatible endpoint over the pool, and the program's copies
            from relax_core.agentic.programs import AgentProgramRollout

            self.agent = AgentProgramRollout(self.cfg, self.rollout, self.tokenizer)
            self.agent.start()
        # world > 1: FSDP data-parallel or megatron model-parallel ranks, one gloo/NCCL group over 127.0.0.1 (single host)
        port = free_port() if world > 1 else 0
        self.actor = RoleGroup(
            Actor,
            "actor",
            world,
            self.pg,
            list(range(world)),
            t.num_cpus,
            t.num_gpus,
            args,
            pass_replica=True,
            env_vars=[rank_env(i, world, port) for i in range(world)] if world > 1 else None,
        )
        self.reference = (
            RoleGroup(Reference, "reference", 1, self.pg, [0], t.num_cpus, t.num_gpus, args)
            if self.use_reference
            else None
        )
        self.algo_roles.start(self.pg)

    def stop_roles(self) -> None:
        if getattr(self, "async_loop", None) is not None:
            self.async_loop.stop()
        if self.agent is not None:
            self.agent.stop()
        self.algo_roles.stop()
        for group in (
            getattr(self, "rollout", None),
            getattr(self, "actor", None),
            getattr(self, "reference", None),
        ):
            if group is not None:
                group.kill()
        if self.pg is not None:
            remove_placement_group(self.pg)

    # ---------------------------------------------------------------- pieces of a step
    def generate(self, prompts: list[PromptRecord], greedy: bool = False) -> list[Sample]:
        if self.agent is not None:  # the agent program plays them through the endpoint
            return self.agent.generate(prompts, greedy)
        if isinstance(self.rollout, RolloutPool):  # routed over every serving engine
            return self.rollout.generate(prompts, greedy)
        chunks = [c for c in split_evenly(prompts, len(self.rollout)) if c]
        refs = [a.generate.remote(c, greedy) for a, c in zip(self.rollout.actors, chunks)]
        return [s for part in ray.get(refs) for s in part]

    def push_weights(self, version: int) -> None:
        if getattr(self, "async_loop", None) is not None:  # WeightSync broadcast instead of the object store
            return self.async_loop.push_weights(version)
        weights = ray.put(self.actor.call_collective("state_dict"))
        if isinstance(self.rollout, RolloutPool):  # every member, and engines that join later
            return self.rollout.push_weights(weights, version)
        ray.get(self.rollout.call("update_weights", weights, version))

    def evaluate(self) -> dict[str, float]:
        if not self.eval_prompts:
            return {}
        samples = self.generate(self.eval_prompts, greedy=True)
        return {
            "eval/accuracy": accuracy(samples),
            "eval/reward": sum(s.reward for s in samples) / len(samples),
        }

    def warm_start(self) -> None:
        """Supervised warm-start on (prompt, label) pairs: teaches the output format before RL."""
        t = self.cfg.trainer
        eos = self.tokenizer.eos_token_id
        for i in range(t.sft_warmup_steps):
            prompts = self.stream.next_batch(t.sft_batch_size)
            samples = []
            if self.cfg.rollout.env is not None:  # agentic: expert episodes against the environment
                from relax_core.agentic.warmstart import expert_samples

                samples = expert_samples(prompts, self.cfg.rollout, self.tokenizer, seed=self.cfg.seed + i)
                prompts = []
            elif self.agent is not None:  # agent program: the rows' demonstration conversations
                from relax_core.agentic.warmstart import demo_samples

                samples, prompts = demo_samples(prompts, self.tokenizer), []
            if self.media is not None:  # pixel/audio tensors of the drawn prompts
                prompts = self.media.materialize(prompts)
            for p in prompts:
                target = self.tokenizer(str(p.label), add_special_tokens=False).input_ids + [eos]
                samples.append(
                    Sample(
                        p.index,
                        0,
                        p.prompt_ids,
                        target,
                        [0.0] * len(target),
                        [1] * len(target),
                        multimodal_inputs=p.multimodal_inputs,
                    )
                )
            batch = TrainBatch.from_samples(samples, self.tokenizer.pad_token_id)
            m = self.actor.call_collective("sft_step", batch)
            if i == 0 or (i + 1) % 10 == 0 or i + 1 == t.sft_warmup_steps:
                log.info("warm-start %d/%d | nll %.4f", i + 1, t.sft_warmup_steps, m["loss"])
        self.actor.call_collective("end_warm_start")
        self.algo_roles.after_warm_start(self.actor, getattr(self, "reference", None))
        self.push_weights(version=0)

    def collect(self, step: int) -> list[Sample]:
        """Stage 1 — Rollout: one step's prompts, sampled and scored."""
        return self.algo_roles.collect(
            self.generate, lambda: self.stream.next_batch(self.cfg.rollout.batch_size)
        )

    def annotate(self, batch: TrainBatch) -> None:
        """Stage 2 — per-token scores other roles add: ref log-probs (KL), behaviour log-probs (ActorFwd)."""
        cfg = self.cfg
        if self.reference is not None:
            batch.extras["ref_logprobs"] = ray.get(self.reference.call("compute_ref_log_probs", batch)[0])
        needs_old_logprobs = cfg.algorithm.ppo_epochs > 1 or (
            cfg.trainer.global_batch_size and cfg.trainer.global_batch_size < len(batch)
        )
        if (
            needs_old_logprobs
        ):  # several updates per batch: the first one's log-probs are the behaviour policy
            batch.extras["old_logprobs"] = self.actor.call_collective("compute_log_probs", batch)
        self.algo_roles.annotate(batch)  # critic values, teacher log-probs

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """Stage 4 — Actor: optimizer step(s) on the batch."""
        critic_metrics = self.algo_roles.update_critic(batch)  # PPO value model, {} otherwise
        if self.algo_roles.actor_frozen():  # critic warm-up: the actor waits
            return critic_metrics
        return critic_metrics | self.actor.call_collective("train", batch)

    def train_step(self, step: int) -> dict[str, float]:
        """collect -> annotate -> advantages -> update -> weights to rollout, timing each stage."""
        times: dict[str, float] = {}

        def timed(name: str, fn, *args):
            t = time.perf_counter()
            result = fn(*args)
            times[f"time/{name}_s"] = time.perf_counter() - t
            return result

        t0 = time.perf_counter()
        samples = timed("rollout", self.collect, step)
        batch = TrainBatch.from_samples(samples, self.tokenizer.pad_token_id)
        timed("logprob", self.annotate, batch)
        batch.extras["advantages"] = timed("advantages", self.advantages.compute, batch)
        train_metrics = timed("train", self.update, batch)
        timed("weight_sync", self.push_weights, step)
        step_time = time.perf_counter() - t0

        response_tokens = int(batch.response_lens.sum())
        metrics = reward_metrics(samples) | train_metrics | times | self.algo_roles.metrics()
        metrics.update(
            kl=train_metrics.get("kl", 0.0),
            step_time_s=step_time,
            tokens_per_s=response_tokens / step_time,
            response_length=response_tokens / len(samples),
            **{"staleness/mean": 0.0, "staleness/max": 0.0},
        )
        if isinstance(self.rollout, RolloutPool):  # samples and engines behind this step (elastic scaling)
            metrics |= self.rollout.step_metrics()
        if self.agent is not None:
            metrics |= self.agent.metrics()
        return metrics

    def start_control_plane(self):
        """HTTP control plane (health, metrics, elastic rollout scaling) when ``control_plane.enabled``."""
        if not self.cfg.control_plane.enabled:
            return None
        from relax_core.control_plane import ControlPlane

        def pool() -> RolloutPool | None:
            rollout = getattr(self, "rollout", None)
            return rollout if isinstance(rollout, RolloutPool) else None

        def latest() -> dict[str, Any]:
            return dict(self.sink.history[-1]) if self.sink is not None and self.sink.history else {}

        return ControlPlane(self.cfg, pool, latest)

    # ---------------------------------------------------------------- the run
    def run(self) -> dict[str, Any]:
        cfg, t = self.cfg, self.cfg.trainer
        resume_from = resolve_resume(t.resume, cfg.output_dir)  # checkpoint/resume (relax_core/checkpoint.py)
        self.checkpoints = CheckpointManager(checkpoint_root(cfg.output_dir), t.save_every, t.keep_last)
        self.sink = MetricsSink(cfg, self.resolved)
        self.start_roles()
        self.health = HealthManager(self, t, cfg.cluster.max_global_restarts)
        self.control_plane = self.start_control_plane()
        summary: dict[str, Any] = {"status": "failed"}
        try:
            step = 1
            if resume_from is not None:
                driver = restore_run(self, resume_from)
                init_eval, start_eval = driver["extra"]["init_eval"], driver["extra"]["start_eval"]
                step = driver["step"] + 1
            else:
                init_eval = self.evaluate()
                if t.sft_warmup_steps:
                    self.warm_start()
                start_eval = self.evaluate() if t.sft_warmup_steps else init_eval
                self.sink.log(0, {f"{k}_init": v for k, v in init_eval.items()} | start_eval)
                log.info(
                    "eval before training: accuracy %.3f (untrained) -> %.3f (after warm-start)",
                    init_eval.get("eval/accuracy", float("nan")),
                    start_eval.get("eval/accuracy", float("nan")),
                )
            evals = {"init_eval": init_eval, "start_eval": start_eval}
            if t.save_every and resume_from is None:  # step 0: what a global restart falls back to
                save_run(self, self.checkpoints, 0, evals)
            self.health.start()
            async_steps = self.async_loop.steps() if getattr(self, "async_loop", None) else None
            while step <= t.total_steps:
                try:
                    if async_steps is not None:  # mode=async: its scheduler yields finished steps in order
                        metrics = next(async_steps)[1] | self.health.metrics()
                    else:
                        metrics = self.health.run_step(step, self.train_step)
                    if (
                        t.eval_every
                        and (step % t.eval_every == 0 or step == t.total_steps)
                        and "eval/accuracy" not in metrics
                    ):
                        metrics |= self.health.guarded(self.evaluate)
                    self.sink.log(step, metrics)
                    log.info(format_step_line(step, t.total_steps, metrics))
                    if self.checkpoints.due(step, t.total_steps) or STOP_REQUEST.is_set():
                        self.health.guarded(functools.partial(save_run, self, self.checkpoints, step, evals))
                except GlobalRestartNeeded as why:  # a dead Actor: everything restarts from a checkpoint
                    step = self.health.global_restart(str(why)) + 1
                    continue
                if STOP_REQUEST.is_set() and step < t.total_steps:  # preempted: saved, the job requeues
                    summary = {"status": "preempted", "steps": step, "output_dir": cfg.output_dir}
                    return summary
                step += 1
            rewards = [r["reward/mean"] for r in self.sink.history if "reward/mean" in r]
            if t.export_final_model:
                self.actor.call_collective("export_hf", f"{cfg.output_dir}/final_model")
            final_eval = self.sink.history[-1] if self.sink.history else {}
            if "eval/accuracy" not in final_eval:
                final_eval = self.evaluate()
            tenth = max(1, len(rewards) // 10)
            summary = {
                "status": "finished",
                "steps": len(rewards),
                "reward_first_10pct": sum(rewards[:tenth]) / tenth,
                "reward_last_10pct": sum(rewards[-tenth:]) / tenth,
                "eval_accuracy_untrained": init_eval.get("eval/accuracy"),
                "eval_accuracy_start": start_eval.get("eval/accuracy"),
                "eval_accuracy_final": final_eval.get("eval/accuracy"),
                "skipped_rows": self.skipped_rows,
                "output_dir": cfg.output_dir,
            }
            summary["reward_gain"] = summary["reward_last_10pct"] - summary["reward_first_10pct"]
            summary |= {k.replace("health/", "health_"): v for k, v in self.health.metrics().items()}
            summary["resumed_from"] = str(resume_from) if resume_from is not None else None
            return summary
        finally:
            self.health.stop()
            if self.control_plane is not None:
                self.control_plane.stop()
            self.stop_roles()
            self.sink.finish(
                {k: v for k, v in summary.items() if v is not None},
                "FINISHED" if summary["status"] == "finished" else "FAILED",
            )
