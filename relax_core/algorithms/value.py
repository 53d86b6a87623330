"""Value-function loss of the PPO Critic."""

from __future__ import annotations

import torch

from relax_core.algorithms.masked import masked_mean


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ℓ_V = ½·mean_t max((V − R)², (V_old + clip(V − V_old, ±ε) − R)²)   (token mean over ``mask``).

    Clipping keeps one batch from moving the value estimate far from the one the advantages were built on;
    ``clip=None`` gives the plain squared error ½·mean (V − R)².
    """
    unclipped = (values - returns).square()
    if clip is None:
        loss_tokens = unclipped
        clip_frac = torch.zeros((), dtype=values.dtype)
    else:
        clipped_values = old_values + (values - old_values).clamp(-clip, clip)
        clipped = (clipped_values - returns).square()
        loss_tokens = torch.maximum(unclipped, clipped)
        clip_frac = masked_mean((clipped > unclipped).float(), mask)
    loss = 0.5 * masked_mean(loss_tokens, mask)
    explained = 1.0 - masked_mean((returns - values.detach()).square(), mask) / masked_mean(
        (returns - masked_mean(returns, mask)).square(), mask
    ).clamp_min(1e-8)
    return loss, {"critic/vf_clip_frac": clip_frac, "critic/explained_var": explained}
