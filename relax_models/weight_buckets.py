"""Weights travel in buckets of bounded size (weight publish, streamed sync): one rule for every backend."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def bucket_by_bytes(
    items: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs into lists whose total size stays within ``bucket_bytes``.

    A single tensor larger than the budget travels alone rather than being split, so receivers always
    get whole parameters.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    used = 0
    for name, tensor in items:
        size = tensor.numel() * tensor.element_size()
        if bucket and used + size > bucket_bytes:
            yield bucket
            bucket, used = [], 0
        bucket.append((name, tensor))
        used += size
    if bucket:
        yield bucket
