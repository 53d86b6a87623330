"""The controller: builds the role groups from the config and runs the training loop of the mode.

Read top to bottom this is one RL step: prompts -> Rollout (generate + reward) -> Reference (ref
log-probs, when a KL term is on) -> Advantages -> Actor (optimizer step) -> weights to the rollout engines.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group

from relax_core.data import PromptStream, dataset_paths, load_prompts
from relax_core.metrics import MetricsSink, format_step_line
from relax_core.ray_groups import RoleGroup
from relax_core.roles.actor import Actor
from relax_core.roles.advantages import Advantages
from relax_core.roles.reference import Reference
from relax_core.roles.rollout import Rollout
from relax_core.samples import PromptRecord, Sample, TrainBatch
from relax_models.loader import load_tokenizer, resolve_model_path

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
        if cfg.rollout.env is not None:
            import relax_core.agentic  # noqa: F401  (registers the agentic synthetic tasks)
        train_path, eval_path = dataset_paths(cfg.data, cfg.output_dir, cfg.seed)
        train, self.skipped_rows = load_prompts(train_path, cfg.data, self.tokenizer)
        self.eval_prompts = load_prompts(eval_path, cfg.data, self.tokenizer)[0] if eval_path else []
        self.stream = PromptStream(train, cfg.seed, cfg.data.shuffle)
        self.advantages = Advantages(cfg)
        self.use_reference = cfg.algorithm.kl_loss_coef > 0
        self.sink: MetricsSink | None = None
        self.pg = None

    # ---------------------------------------------------------------- role groups
    def start_roles(self) -> None:
        """Colocate: every role shares each bundle of one placement group and they take turns."""
        r, t = self.cfg.rollout, self.cfg.trainer
        per_bundle_cpu = r.num_cpus + t.num_cpus * (2 if self.use_reference else 1)
        per_bundle_gpu = r.num_gpus + t.num_gpus * (2 if self.use_reference else 1)
        bundle = {"CPU": per_bundle_cpu} | ({"GPU": per_bundle_gpu} if per_bundle_gpu else {})
        self.pg = placement_group([bundle] * r.num_engines, strategy="PACK")
        ray.get(self.pg.ready(), timeout=120)
        args = (self.cfg, self.model_path)
        self.rollout = RoleGroup(
            Rollout,
            "rollout",
            r.num_engines,
            self.pg,
            list(range(r.num_engines)),
            r.num_cpus,
            r.num_gpus,
            args,
            pass_replica=True,
        )
        self.actor = RoleGroup(Actor, "actor", 1, self.pg, [0], t.num_cpus, t.num_gpus, args)
        self.reference = (
            RoleGroup(Reference, "reference", 1, self.pg, [0], t.num_cpus, t.num_gpus, args)
            if self.use_reference
            else None
        )

    def stop_roles(self) -> None:
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
        chunks = [c for c in split_evenly(prompts, len(self.rollout)) if c]
        refs = [a.generate.remote(c, greedy) for a, c in zip(self.rollout.actors, chunks)]
        return [s for part in ray.get(refs) for s in part]

    def push_weights(self, version: int) -> None:
        weights = ray.put(ray.get(self.actor.call("state_dict")[0]))
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
            for p in prompts:
                target = self.tokenizer(str(p.label), add_special_tokens=False).input_ids + [eos]
                samples.append(
                    Sample(p.index, 0, p.prompt_ids, target, [0.0] * len(target), [1] * len(target))
                )
            batch = TrainBatch.from_samples(samples, self.tokenizer.pad_token_id)
            m = ray.get(self.actor.call("sft_step", batch)[0])
            if i == 0 or (i + 1) % 10 == 0 or i + 1 == t.sft_warmup_steps:
                log.info("warm-start %d/%d | nll %.4f", i + 1, t.sft_warmup_steps, m["loss"])
        ray.get(self.actor.call("end_warm_start")[0])
        self.push_weights(version=0)

    def collect(self, step: int) -> list[Sample]:
        """Stage 1 — Rollout: one step's prompts, sampled and scored."""
        return self.generate(self.stream.next_batch(self.cfg.rollout.batch_size))

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
            batch.extras["old_logprobs"] = ray.get(self.actor.call("compute_log_probs", batch)[0])

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """Stage 4 — Actor: optimizer step(s) on the batch."""
        return ray.get(self.actor.call("train", batch)[0])

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
        metrics = reward_metrics(samples) | train_metrics | times
        metrics.update(
            kl=train_metrics.get("kl", 0.0),
            step_time_s=step_time,
            tokens_per_s=response_tokens / step_time,
            response_length=response_tokens / len(samples),
            **{"staleness/mean": 0.0, "staleness/max": 0.0},
        )
        return metrics

    # ---------------------------------------------------------------- the run
    def run(self) -> dict[str, Any]:
        cfg, t = self.cfg, self.cfg.trainer
        self.sink = MetricsSink(cfg, self.resolved)
        self.start_roles()
        summary: dict[str, Any] = {"status": "failed"}
        try:
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
            rewards = []
            for step in range(1, t.total_steps + 1):
                metrics = self.train_step(step)
                if t.eval_every and (step % t.eval_every == 0 or step == t.total_steps):
                    metrics |= self.evaluate()
                rewards.append(metrics["reward/mean"])
                self.sink.log(step, metrics)
                log.info(format_step_line(step, t.total_steps, metrics))
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
            return summary
        finally:
            self.stop_roles()
            self.sink.finish(
                {k: v for k, v in summary.items() if v is not None},
                "FINISHED" if summary["status"] == "finished" else "FAILED",
            )
