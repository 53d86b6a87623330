"""Advantages role: rewards (+ values, ref log-probs when an estimator needs them) -> advantages."""

from __future__ import annotations

import inspect

import torch

from relax_core.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS
from relax_core.algorithms.advantages import distillation_advantages
from relax_core.samples import TrainBatch


def behaviour_logprobs(batch: TrainBatch) -> torch.Tensor:
    """log π of the policy that sampled: ActorFwd's ``old_logprobs`` when present, else the engine's."""
    return batch.extras.get("old_logprobs", batch.rollout_logprobs)


class Advantages:
    def __init__(self, cfg) -> None:
        self.cfg = cfg.algorithm

    def estimator_inputs(self, batch: TrainBatch) -> dict:
        """Every optional input an estimator may take; each estimator receives the ones it names."""
        a = self.cfg
        inputs = {
            "norm_by_std": a.norm_adv_by_std,
            "gamma": a.gamma,
            "lam": a.lam,
            "values": batch.extras.get("values"),
            "kl_reward_coef": a.kl_reward_coef,
            "kl": None,
        }
        if a.kl_reward_coef and "ref_logprobs" in batch.extras:
            # reward-side KL of the behaviour policy against the reference, per token
            inputs["kl"] = (
                KL_ESTIMATORS.get(a.kl_estimator)(behaviour_logprobs(batch), batch.extras["ref_logprobs"])
                * batch.loss_mask
            )
        return inputs

    def compute(self, batch: TrainBatch) -> torch.Tensor:
        estimator = ADVANTAGE_ESTIMATORS.get(self.cfg.advantage_estimator)
        accepted = inspect.signature(estimator).parameters
        kwargs = {k: v for k, v in self.estimator_inputs(batch).items() if k in accepted}
        advantages = estimator(batch.rewards, batch.group_ids, batch.loss_mask, **kwargs)
        teacher = self.cfg.teacher
        if teacher is not None and "teacher_logprobs" in batch.extras:
            if teacher.teacher_only:
                advantages = torch.zeros_like(advantages)
            advantages = distillation_advantages(
                advantages,
                behaviour_logprobs(batch),
                batch.extras["teacher_logprobs"],
                batch.loss_mask,
                teacher.coef,
            )
        return advantages
