"""Advantage estimators: rewards (one per sample) -> per-token advantages ``[B, R]``."""

from __future__ import annotations

import torch

from relax_core.algorithms.registry import ADVANTAGE_ESTIMATORS


def group_stats(
    values: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample mean, unbiased std and size of the sample's group (groups by id, not position).

    A group of one has std 0.
    """
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    counts_f = counts.to(values.dtype)
    sums = torch.zeros_like(counts_f).index_add_(0, inverse, values)
    means = sums / counts_f
    sq = torch.zeros_like(counts_f).index_add_(0, inverse, (values - means[inverse]) ** 2)
    std = torch.where(counts > 1, (sq / (counts_f - 1).clamp_min(1.0)).sqrt(), torch.zeros_like(sq))
    return means[inverse], std[inverse], counts[inverse]


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-normalised outcome advantage, broadcast over the response tokens.

    A_i = (r_i − mean_g(r)) / (std_g(r) + eps)   with the unbiased std of sample i's group g;
    A_i = r_i − mean_g(r)                        when ``norm_by_std`` is false (Dr. GRPO).
    All-equal rewards in a group give A = 0 for its samples.
    """
    mean, std, _ = group_stats(rewards, group_ids)
    adv = rewards - mean
    if norm_by_std:
        adv = adv / (std + eps)
    return adv.unsqueeze(-1) * loss_mask
