"""Policy losses: per-token loss matrices ``[B, R]`` (to be aggregated) plus diagnostics.

Every loss takes the current log-probs, the behaviour ("old") log-probs, per-token advantages, the loss
mask and the algorithm config, and returns ``(loss, metrics)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from relax_core.algorithms.masked import masked_mean
from relax_core.algorithms.registry import POLICY_LOSSES

if TYPE_CHECKING:
    from relax_core.config.schema import AlgorithmConfig

# |log π − log π_old| beyond this is numerically meaningless and would overflow exp()
LOG_RATIO_CLAMP = 20.0


def importance_ratio(
    logprob: torch.Tensor, old_logprob: torch.Tensor, clamp: float = LOG_RATIO_CLAMP
) -> tuple[torch.Tensor, torch.Tensor]:
    """r = exp(clamp(log π − log π_old, ±clamp)); returns (ratio, log_ratio)."""
    log_ratio = (logprob - old_logprob).clamp(-clamp, clamp)
    return log_ratio.exp(), log_ratio


def _clamp_of(cfg: AlgorithmConfig) -> float:
    return float(getattr(cfg, "log_ratio_clamp", None) or LOG_RATIO_CLAMP)


def ratio_metrics(
    ratio: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """approx KL ½·mean(log r)² and mean/min/max of the ratio over trained tokens."""
    any_token = bool(mask.any())
    big = torch.finfo(ratio.dtype).max
    return {
        "approx_kl": masked_mean(0.5 * log_ratio.square(), mask),
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_max": ratio.masked_fill(mask == 0, -big).max() if any_token else ratio.new_zeros(()),
        "ratio_min": ratio.masked_fill(mask == 0, big).min() if any_token else ratio.new_zeros(()),
    }


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, cfg: AlgorithmConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ℓ = max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)) and the fraction of tokens where the clip binds."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    return torch.maximum(unclipped, clipped), {"clip_frac": masked_mean((clipped > unclipped).float(), mask)}


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: AlgorithmConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with separate bounds and dual clip.

    ℓ = max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high));
    for A < 0 with dual clip c > 1:  ℓ = min(ℓ, −A·c)  (bounds the loss when r ≫ 1).
    """
    ratio, log_ratio = importance_ratio(logprob, old_logprob, _clamp_of(cfg))
    loss, metrics = clipped_surrogate(ratio, advantages, mask, cfg)
    if cfg.clip_c is not None:
        if cfg.clip_c <= 1.0:
            raise ValueError(f"dual-clip constant clip_c must be > 1, got {cfg.clip_c}")
        dual = -advantages * cfg.clip_c
        negative = advantages < 0
        metrics["dual_clip_frac"] = masked_mean((negative & (loss > dual)).float(), mask)
        loss = torch.where(negative, torch.minimum(loss, dual), loss)
    metrics.update(ratio_metrics(ratio, log_ratio, mask))
    return loss, metrics


@POLICY_LOSSES.register("gspo")
def gspo_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: AlgorithmConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: one importance ratio per sequence, clipped like PPO.

    s_i = exp( Σ_t m·(log π − log π_old) / Σ_t m );  per token s_{i,t} = sg[s_i]·π(y_t)/sg[π(y_t)]
    (same value as s_i; its gradient spreads s_i·∇log π over the tokens);
    ℓ_{i,t} = max(−A·s_{i,t}, −A·clip(s_{i,t}, 1−ε_low, 1+ε_high)).
    Pair with ``seq-mean-token-mean`` so each sequence weighs the same.
    """
    clamp = _clamp_of(cfg)
    log_ratio = (logprob - old_logprob).clamp(-clamp, clamp)
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1)
    token_log_ratio = seq_log_ratio.detach().unsqueeze(-1) + logprob - logprob.detach()
    ratio = token_log_ratio.clamp(-clamp, clamp).exp()
    loss, metrics = clipped_surrogate(ratio, advantages, mask, cfg)
    metrics.update(ratio_metrics(ratio, log_ratio, mask))
    return loss, metrics


@POLICY_LOSSES.register("sapo")
def sapo_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: AlgorithmConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO: a smooth, temperature-controlled gate replaces the hard clip.

    f(r) = (4/τ)·σ(τ·(r − 1)),   ℓ = −f(r)·A,   τ = τ_pos if A > 0 else τ_neg.
    At r = 1 the gradient equals the on-policy one (∇f = 4σ(1−σ)·r·∇log π = ∇log π); far from r = 1 it
    decays smoothly instead of dropping to zero. A = 0 gives ℓ = 0 and no gradient.
    """
    ratio, log_ratio = importance_ratio(logprob, old_logprob, _clamp_of(cfg))
    tau = torch.where(
        advantages > 0, torch.full_like(ratio, cfg.tau_pos), torch.full_like(ratio, cfg.tau_neg)
    )
    gate = 4.0 / tau * torch.sigmoid(tau * (ratio - 1.0))
    loss = -gate * advantages
    # share of tokens whose gate weight 4σ(1−σ) fell below one half (the soft analogue of clipping)
    sig = torch.sigmoid(tau * (ratio - 1.0))
    metrics = {"clip_frac": masked_mean((4.0 * sig * (1.0 - sig) < 0.5).float(), mask)}
    metrics.update(ratio_metrics(ratio, log_ratio, mask))
    return loss, metrics


@POLICY_LOSSES.register("cispo")
def cispo_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: AlgorithmConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO: clip the importance-sampling *weight*, never the token's gradient.

    ℓ = −sg[clip(r, 1−ε_low, 1+ε_high)]·A·log π   (every token keeps a gradient, scaled by the weight).
    """
    ratio, log_ratio = importance_ratio(logprob, old_logprob, _clamp_of(cfg))
    weight = ratio.detach().clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    loss = -weight * advantages * logprob
    metrics = {"clip_frac": masked_mean((weight != ratio.detach()).float(), mask)}
    metrics.update(ratio_metrics(ratio, log_ratio, mask))
    return loss, metrics
