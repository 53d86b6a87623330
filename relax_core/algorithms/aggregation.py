"""Loss aggregation: a per-token loss matrix ``[B, R]`` and its mask -> one scalar."""

from __future__ import annotations

import torch

from relax_core.algorithms.masked import masked_mean
from relax_core.algorithms.registry import LOSS_AGGREGATIONS


@LOSS_AGGREGATIONS.register("token-mean")
def token_mean(loss: torch.Tensor, mask: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Σ_{i,t} m·ℓ / Σ_{i,t} m — every trained token weighs the same (DAPO's token-level loss)."""
    return masked_mean(loss, mask)


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """mean_i [ Σ_t m·ℓ / Σ_t m ] over sequences with at least one trained token."""
    per_seq = masked_mean(loss, mask, dim=-1)
    has_tokens = (mask.sum(-1) > 0).to(loss.dtype)
    return (per_seq * has_tokens).sum() / has_tokens.sum().clamp_min(1.0)


@LOSS_AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(loss: torch.Tensor, mask: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """mean_i [ Σ_t m·ℓ ]."""
    return (loss * mask).sum(-1).mean()


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    loss: torch.Tensor, mask: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Σ_{i,t} m·ℓ / (B · C) with a constant C (Dr. GRPO).

    Without ``scale``, C is the padded width of ``loss``, which varies with the micro-batch: the Actor always
    passes one (``algorithm.loss_scale``, else ``rollout.max_new_tokens``).
    """
    constant = float(scale) if scale is not None else float(loss.shape[-1])
    if constant <= 0:
        raise ValueError(f"seq-mean-token-sum-norm needs a positive scale, got {constant}")
    return (loss * mask).sum() / (loss.shape[0] * constant)
