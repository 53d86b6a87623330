"""KL estimators between the policy and a reference, per token (Schulman's k1/k2/k3)."""

from __future__ import annotations

import torch

from relax_core.algorithms.registry import KL_ESTIMATORS


@KL_ESTIMATORS.register("k1")
def kl_k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k1 = log π − log π_ref (unbiased, high variance, can be negative)."""
    return logprob - ref_logprob


@KL_ESTIMATORS.register("k2")
def kl_k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k2 = ½ (log π − log π_ref)²."""
    return 0.5 * (logprob - ref_logprob).square()


@KL_ESTIMATORS.register("k3", "low_var_kl")
def kl_k3(logprob: torch.Tensor, ref_logprob: torch.Tensor, clamp: float = 10.0) -> torch.Tensor:
    """k3 = exp(log π_ref − log π) − (log π_ref − log π) − 1 ≥ 0, clamped to [−clamp, clamp].

    The log-ratio is clamped to ±20 first so exp() cannot overflow.
    """
    log_ratio = (ref_logprob - logprob).clamp(-20.0, 20.0)
    return (log_ratio.exp() - log_ratio - 1.0).clamp(-clamp, clamp)
