"""Advantages role: rewards (+ values, ref log-probs when an estimator needs them) -> advantages."""

from __future__ import annotations

import torch

from relax_core.algorithms import ADVANTAGE_ESTIMATORS
from relax_core.samples import TrainBatch


class Advantages:
    def __init__(self, cfg) -> None:
        self.cfg = cfg.algorithm

    def compute(self, batch: TrainBatch) -> torch.Tensor:
        estimator = ADVANTAGE_ESTIMATORS.get(self.cfg.advantage_estimator)
        return estimator(
            batch.rewards, batch.group_ids, batch.loss_mask, norm_by_std=self.cfg.norm_adv_by_std
        )
