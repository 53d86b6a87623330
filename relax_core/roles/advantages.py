"""Advantages role: rewards (+ values, ref log-probs when an estimator needs them) -> advantages."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch

from relax_core.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS
from relax_core.algorithms.advantages import distillation_advantages
from relax_core.databus import DataBus
from relax_core.databus.records import SAMPLE_FIELDS, batch_from_rows, per_sample
from relax_core.databus.stages import stream_stage
from relax_core.samples import TrainBatch

if TYPE_CHECKING:
    from relax_core.config.schema import RelaxConfig


def behaviour_logprobs(batch: TrainBatch) -> torch.Tensor:
    """log π of the policy that sampled: ActorFwd's ``old_logprobs`` when present, else the engine's."""
    return batch.extras.get("old_logprobs", batch.rollout_logprobs)


class Advantages:
    def __init__(
        self,
        cfg: RelaxConfig,
        bus: DataBus | None = None,
        pad_token_id: int = 0,
        inputs: tuple[str, ...] = (),
        group_local: bool = False,
    ) -> None:
        """``bus`` (mode=async): the step's rows are read from it; ``inputs`` are the per-token fields the
        estimator waits for besides the Rollout's, and ``group_local`` estimators run per prompt group as
        groups land instead of once per step."""
        self.cfg = cfg.algorithm
        self.group_size = cfg.rollout.n_samples_per_prompt
        self.bus, self.pad, self.inputs, self.group_local = bus, pad_token_id, list(inputs), group_local
        if bus is not None:  # tiny tensor ops: a thread pool per core would only contend with the roles
            torch.set_num_threads(1)

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

    def process(self, step: int, total: int) -> dict[str, float]:
        """mode=async: advantages of step ``step``'s rows into the bus."""

        def fn(keys, rows):
            batch = batch_from_rows(rows, self.pad, self.inputs)
            return {"advantages": per_sample(self.compute(batch), batch)}

        need = SAMPLE_FIELDS + self.inputs
        waited = stream_stage(
            self.bus, step, total, need, "advantages", total, fn, not self.group_local, self.group_size
        )
        return {"time/advantages_wait_s": waited}
