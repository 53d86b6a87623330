"""What the algorithm suite adds to the colocated loop: Critic/Teacher groups and their stage work.

The controller calls one hook per stage (``collect``, ``annotate``, ``update``, ``start_roles``); this
module decides what each algorithm needs there, so the controller stays one readable RL step:

- collect:  DAPO soft overlong penalty and dynamic sampling (drop zero-spread groups, over-sample more
            prompts until ``rollout.batch_size`` groups with signal are found or ``max_gen_batches`` is hit)
- annotate: Critic values (PPO), Teacher log-probs (on-policy distillation)
- update:   Critic training on GAE returns; the actor waits during ``critic.warmup_steps``

``mode=async`` runs the same Critic/Teacher classes as bus roles and the same shaping functions in its
Rollout (relax_core/async_loop.py).
"""

from __future__ import annotations

import logging
from typing import Any

import ray
import torch

from relax_core.algorithms.shaping import groups_with_spread, overlong_penalty
from relax_core.ray_groups import RoleGroup
from relax_core.samples import Sample, TrainBatch

log = logging.getLogger("relax")


# what a step logs for the actor while the critic warms up (the step line and sinks expect these keys)
FROZEN_ACTOR_METRICS = {"loss": 0.0, "entropy": float("nan"), "actor_frozen": 1.0}


def needs_reference(algorithm_cfg) -> bool:
    """The Reference role runs for a KL loss term or a reward-side KL penalty."""
    return algorithm_cfg.kl_loss_coef > 0 or algorithm_cfg.kl_reward_coef > 0


def critic_warming_up(algorithm_cfg, step: int) -> bool:
    """True for RL steps 1..``critic.warmup_steps``: the actor does not move until the values mean something."""
    return algorithm_cfg.critic is not None and step <= algorithm_cfg.critic.warmup_steps


def shape_rewards(samples: list[Sample], algorithm_cfg, max_new_tokens: int) -> list[Sample]:
    """DAPO's soft overlong penalty added to each sample's reward (in place; a no-op when the buffer is 0)."""
    a = algorithm_cfg
    if a.overlong_buffer > 0 and samples:
        lens = torch.tensor([len(s.response_ids) for s in samples])
        penalty = overlong_penalty(lens, max_new_tokens, a.overlong_buffer, a.overlong_penalty_factor)
        for sample, p in zip(samples, penalty.tolist(), strict=True):
            sample.reward += p
            sample.reward_extras["overlong_penalty"] = p
    return samples


def with_spread(samples: list[Sample]) -> list[Sample]:
    """The samples whose prompt group's rewards are not all equal (dynamic sampling keeps only these)."""
    if not samples:
        return []
    keep = groups_with_spread(
        torch.tensor([s.reward for s in samples]), torch.tensor([s.group_id for s in samples])
    )
    return [s for s, k in zip(samples, keep.tolist(), strict=True) if k]


def dynamic_sampling_metrics(
    rounds: int, kept_groups: int, generated_groups: int, generated_rewards: list[float]
) -> dict[str, float]:
    return {
        "dynamic_sampling/gen_batches": float(rounds),
        "dynamic_sampling/kept_group_frac": kept_groups / max(generated_groups, 1),
        "dynamic_sampling/reward_all_mean": sum(generated_rewards) / max(len(generated_rewards), 1),
    }


class AlgorithmRoles:
    def __init__(self, cfg, model_path: str) -> None:
        self.cfg = cfg
        self.algo = cfg.algorithm
        self.model_path = model_path
        self.critic: RoleGroup | None = None
        self.teacher: RoleGroup | None = None
        self.teacher_path: str | None = None
        self.step_metrics: dict[str, float] = {}
        self.updates = 0
        if self.algo.teacher is not None:
            from relax_core.roles.teacher import check_tokenizer_match, resolve_teacher_path

            self.teacher_path = resolve_teacher_path(cfg)  # trains the default teacher once if missing
            check_tokenizer_match(model_path, self.teacher_path)

    @property
    def extra_trainers(self) -> int:
        """Model-holding roles this algorithm adds to bundle 0 (each reserves ``trainer.num_cpus``)."""
        return int(self.algo.critic is not None) + int(self.algo.teacher is not None)

    # ---------------------------------------------------------------- roles
    def start(self, pg) -> None:
        t = self.cfg.trainer
        if self.algo.critic is not None:
            from relax_core.roles.critic import Critic

            self.critic = RoleGroup(
                Critic, "critic", 1, pg, [0], t.num_cpus, t.num_gpus, (self.cfg, self.model_path)
            )
        if self.algo.teacher is not None:
            from relax_core.roles.teacher import Teacher

            self.teacher = RoleGroup(
                Teacher, "teacher", 1, pg, [0], t.num_cpus, t.num_gpus, (self.cfg, self.teacher_path)
            )

    def stop(self) -> None:
        for group in (self.critic, self.teacher):
            if group is not None:
                group.kill()
        self.critic = self.teacher = None

    def after_warm_start(self, actor, reference) -> None:
        """RL starts from the warm-started policy: the Reference and the Critic's trunk take its weights."""
        if self.critic is None and reference is None:
            return
        weights = ray.put(actor.call_collective("state_dict"))
        if reference is not None:
            ray.get(reference.call("update_weights", weights))
        if self.critic is not None:
            ray.get(self.critic.call("load_trunk", weights))

    def save_checkpoint(self, path: str) -> list:
        """Start writing the Critic (when there is one) under ``path``; returns refs to wait on. The
        Teacher is frozen and reloads from its folder."""
        if self.critic is None:
            return []
        return self.critic.call("save_checkpoint", f"{path}/critic")

    def load_checkpoint(self, path: str, updates: int) -> None:
        """Restore the Critic written by :meth:`save_checkpoint` and the update count of the warm-up."""
        self.updates = updates
        if self.critic is not None:
            ray.get(self.critic.call("load_checkpoint", f"{path}/critic"))

    # ---------------------------------------------------------------- stages
    def collect(self, generate, next_prompts) -> list[Sample]:
        """Stage 1 with DAPO's reward shaping and dynamic sampling; ``generate(next_prompts())`` samples."""
        a, batch_size, max_len = self.algo, self.cfg.rollout.batch_size, self.cfg.rollout.max_new_tokens
        samples = shape_rewards(generate(next_prompts()), a, max_len)
        self.step_metrics = {}
        if not a.dynamic_sampling:
            return samples
        generated, kept, rounds = list(samples), with_spread(samples), 1
        while _num_groups(kept) < batch_size and rounds < a.max_gen_batches:
            more = shape_rewards(generate(next_prompts()), a, max_len)
            generated += more
            kept += with_spread(more)
            rounds += 1
        self.step_metrics = dynamic_sampling_metrics(
            rounds, _num_groups(kept), _num_groups(generated), [s.reward for s in generated]
        )
        if not kept:  # nothing with signal: train on the last round (zero advantages, no policy change)
            return samples
        keep_ids = list(dict.fromkeys(s.group_id for s in kept))[:batch_size]
        wanted = set(keep_ids)
        return [s for s in kept if s.group_id in wanted]

    def annotate(self, batch: TrainBatch) -> None:
        """Stage 2: per-token values (Critic) and teacher log-probs (Teacher) into ``batch.extras``."""
        refs = {}
        if self.critic is not None:
            refs["values"] = self.critic.call("compute_values", batch)[0]
        if self.teacher is not None:
            refs["teacher_logprobs"] = self.teacher.call("compute_log_probs", batch)[0]
        for key, value in zip(refs, ray.get(list(refs.values())), strict=True):
            batch.extras[key] = value

    def update_critic(self, batch: TrainBatch) -> dict[str, float]:
        """Stage 4a: the Critic regresses on the GAE returns of this batch (:meth:`Critic.fit`)."""
        self.updates += 1
        if self.critic is None:
            return {}
        metrics = ray.get(self.critic.call("fit", batch)[0])
        if self.actor_frozen():
            metrics |= FROZEN_ACTOR_METRICS
        return metrics

    def actor_frozen(self) -> bool:
        """True during the critic warm-up: the actor does not move until the values mean something."""
        return critic_warming_up(self.algo, self.updates)

    def metrics(self) -> dict[str, Any]:
        return dict(self.step_metrics)


def _num_groups(samples: list[Sample]) -> int:
    return len({s.group_id for s in samples})
