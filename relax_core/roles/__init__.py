"""The roles of an RL run, one plain class each (no Ray inside: relax_core/runtime/groups.py wraps them)."""

from __future__ import annotations

import os

import torch


def use_threads(count: int | None) -> None:
    """torch CPU threads of this role's process: ``count``, or every core when it is null."""
    torch.set_num_threads(count or os.cpu_count() or 1)
