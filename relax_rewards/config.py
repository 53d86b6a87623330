"""Schema of the ``reward`` config group (``conf/reward/``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RewardConfig:
    """Which reward scores a response, and how the executor runs it."""

    # a registered reward (relax_rewards.available()); per-sample metadata.rm_type overrides it
    name: str = "digits"
    # dotted path "pkg.mod.fn" or "path/to/file.py:fn" of a custom reward; wins over ``name``
    _target_: str | None = None
    # for dict-valued rewards: the entry that becomes the training reward
    key: str | None = None
    # options passed to the reward function as keyword arguments
    kwargs: dict[str, Any] = field(default_factory=dict)
    # 0 scores in the calling process; >0 uses a process pool of that size
    num_workers: int = 0
    timeout_s: float = 10.0
    # modules ("pkg.mod" or "path/to/file.py") imported first; the rewards they @register can then be
    # chosen by name, including by a sample's rm_type (which never loads code by path itself)
    plugins: list[str] = field(default_factory=list)
    # how worker processes start: "spawn" (default: clean, sees the current sys.path), "forkserver", "fork"
    start_method: str = "spawn"
