"""The training objective an algorithm config composes from the registries."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from relax_core.algorithms.masked import masked_mean
from relax_core.algorithms.registry import KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES
from relax_core.samples import TrainBatch

if TYPE_CHECKING:
    from relax_core.config.schema import AlgorithmConfig


def truncated_is_weights(
    old_logprob: torch.Tensor, rollout_logprob: torch.Tensor, cap: float, clamp: float = 20.0
) -> torch.Tensor:
    """Truncated importance sampling against the rollout engine: w = min(exp(log π_old − log π_rollout), C).

    Corrects the mismatch between the engine that sampled and the trainer that scores (different kernels,
    precision, stale weights); detached, so it only reweights the policy-gradient terms.
    """
    log_w = (old_logprob.detach() - rollout_logprob).clamp(-clamp, clamp)
    return log_w.exp().clamp(max=cap)


def policy_objective(
    batch: TrainBatch,
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    cfg: AlgorithmConfig,
    weight: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """loss = agg(w_TIS·ℓ_policy) − c_H·agg(H) + c_KL·agg(KL(π‖π_ref)), times ``weight``.

    ``batch.extras`` must hold ``advantages`` and, off-policy, ``old_logprobs`` (else the detached current
    log-probs are used: ratio 1, the on-policy case); ``ref_logprobs`` when ``cfg.kl_loss_coef > 0``.
    ``weight`` is this micro-batch's share of the optimizer batch so accumulated gradients equal the
    gradient of the whole batch's loss.
    """
    mask = batch.loss_mask
    old = batch.extras.get("old_logprobs", logprobs.detach())
    aggregate = LOSS_AGGREGATIONS.get(cfg.loss_agg_mode)
    pg_loss_tokens, metrics = POLICY_LOSSES.get(cfg.policy_loss)(
        logprobs, old, batch.extras["advantages"], mask, cfg
    )
    if getattr(cfg, "tis_cap", None):
        weights = truncated_is_weights(old, batch.rollout_logprobs, cfg.tis_cap)
        pg_loss_tokens = pg_loss_tokens * weights
        metrics["tis/weight_mean"] = masked_mean(weights, mask)
        metrics["tis/clip_frac"] = masked_mean((weights >= cfg.tis_cap).float(), mask)
    pg_loss = aggregate(pg_loss_tokens, mask, cfg.loss_scale)
    entropy_mean = masked_mean(entropy, mask)
    loss = pg_loss
    if cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * aggregate(entropy, mask, cfg.loss_scale)
    if cfg.kl_loss_coef > 0:
        kl_tokens = KL_ESTIMATORS.get(cfg.kl_estimator)(logprobs, batch.extras["ref_logprobs"])
        kl = aggregate(kl_tokens, mask, cfg.loss_scale)
        loss = loss + cfg.kl_loss_coef * kl
        metrics["kl"] = kl
    out = {k: float(v.detach()) for k, v in metrics.items()}
    out.update(pg_loss=float(pg_loss.detach()), entropy=float(entropy_mean.detach()))
    return loss * weight, out


def sequence_count(batch: TrainBatch, cfg: AlgorithmConfig) -> int:
    """Sequences the aggregation averages over: seq-mean-token-mean skips rows with no trained token."""
    if cfg.loss_agg_mode == "seq-mean-token-mean":
        return int((batch.loss_mask.sum(-1) > 0).sum())
    return len(batch)


def micro_batch_weight(
    micro: TrainBatch, total_tokens: float, total_seqs: int, cfg: AlgorithmConfig
) -> float:
    """Share of one micro-batch in the optimizer batch for the configured aggregation.

    token-mean: tokens(micro) / total_tokens; the sequence means: sequence_count(micro) / total_seqs, where
    ``total_seqs`` is :func:`sequence_count` of the optimizer batch.
    """
    if cfg.loss_agg_mode == "token-mean":
        return float(micro.loss_mask.sum()) / max(total_tokens, 1.0)
    return sequence_count(micro, cfg) / max(total_seqs, 1)
