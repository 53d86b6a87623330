"""Masked reductions shared by every algorithm function."""

from __future__ import annotations

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x·m) / sum(m); 0 where the mask is empty (a fully masked row contributes nothing)."""
    return (
        masked_sum(x, mask, dim) / mask.sum(dim).clamp_min(1.0)
        if dim is not None
        else (masked_sum(x, mask) / mask.sum().clamp_min(1.0))
    )


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x − mean) / sqrt(var + eps) over masked entries (batch whitening), computed in float64, in x's dtype.

    All-equal masked entries whiten to exactly 0: their summed mean can be an ulp off, which the rsqrt(eps)
    of a zero variance would scale up to ~1e-3.
    """
    x64, m = x.to(torch.float64), mask.to(torch.float64)
    lo = torch.where(mask > 0, x64, torch.inf).min()
    hi = torch.where(mask > 0, x64, -torch.inf).max()
    mean = torch.where(lo == hi, lo, masked_mean(x64, m))
    var = masked_mean((x64 - mean) ** 2, m)
    return ((x64 - mean) * torch.rsqrt(var + eps)).to(x.dtype)
