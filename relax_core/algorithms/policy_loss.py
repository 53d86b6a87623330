"""Policy losses: per-token loss matrices ``[B, R]`` (to be aggregated) plus diagnostics.

Every loss takes the current log-probs, the behaviour ("old") log-probs, per-token advantages, the loss
mask and the algorithm config, and returns ``(loss, metrics)``.
"""

from __future__ import annotations

import torch

from relax_core.algorithms.masked import masked_mean
from relax_core.algorithms.registry import POLICY_LOSSES

# |log π − log π_old| beyond this is numerically meaningless and would overflow exp()
LOG_RATIO_CLAMP = 20.0


def importance_ratio(logprob: torch.Tensor, old_logprob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """r = exp(clamp(log π − log π_old, ±20)); returns (ratio, log_ratio)."""
    log_ratio = (logprob - old_logprob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return log_ratio.exp(), log_ratio


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with separate bounds and dual clip.

    ℓ = max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high));
    for A < 0 with dual clip c > 1:  ℓ = min(ℓ, −A·c)  (bounds the loss when r ≫ 1).
    """
    ratio, log_ratio = importance_ratio(logprob, old_logprob)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {"clip_frac": masked_mean((clipped > unclipped).float(), mask)}
    if cfg.clip_c is not None:
        if cfg.clip_c <= 1.0:
            raise ValueError(f"dual-clip constant clip_c must be > 1, got {cfg.clip_c}")
        dual = -advantages * cfg.clip_c
        negative = advantages < 0
        metrics["dual_clip_frac"] = masked_mean((negative & (loss > dual)).float(), mask)
        loss = torch.where(negative, torch.minimum(loss, dual), loss)
    metrics["approx_kl"] = masked_mean(0.5 * log_ratio.square(), mask)
    metrics["ratio_mean"] = masked_mean(ratio, mask)
    metrics["ratio_max"] = (ratio * mask).max() if mask.any() else ratio.new_zeros(())
    return loss, metrics
