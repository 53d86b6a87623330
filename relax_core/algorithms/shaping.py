"""Reward shaping and batch selection that act on whole samples before advantages (DAPO)."""

from __future__ import annotations

import torch


def overlong_penalty(
    response_lens: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment added to the reward, per sample.

    p(L) = 0                                 for L ≤ L_max − L_buf
         = factor·(L_max − L_buf − L)/L_buf  for L_max − L_buf < L ≤ L_max   (linear from 0 to −factor)
         = −factor                           for L > L_max
    ``buffer`` ≤ 0 turns it off (all zeros).
    """
    lens = response_lens.to(torch.float)
    if buffer <= 0:
        return torch.zeros_like(lens)
    start = float(max_len - buffer)
    penalty = (start - lens) / float(buffer) * factor
    penalty = torch.where(lens <= start, torch.zeros_like(lens), penalty)
    return penalty.clamp(min=-factor)


def groups_with_spread(rewards: torch.Tensor, group_ids: torch.Tensor, min_std: float = 0.0) -> torch.Tensor:
    """DAPO dynamic sampling: a boolean per sample, true when its group's rewards are not all equal.

    A group whose rewards are all equal (all solved, all failed, or a group of one) has zero group-relative
    advantage and only dilutes the batch; the population std must exceed ``min_std``.
    """
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    r = rewards.to(torch.float64)
    sums = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, r)
    means = sums / counts
    sq = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, (r - means[inverse]) ** 2)
    std = (sq / counts).sqrt()
    keep = (counts > 1) & (std > max(min_std, 1e-12))
    return keep[inverse]
