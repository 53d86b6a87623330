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
    """(x − mean) / sqrt(var + eps) over masked entries (batch whitening)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + eps)
