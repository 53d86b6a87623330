"""Learning-rate schedule shared by every training backend, so ``trainer.lr_decay`` means one thing."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


def lr_multiplier(trainer_cfg: Any) -> Callable[[int], float]:
    """Factor on ``lr`` after ``step`` optimizer steps (``LambdaLR`` convention: step 0 is the first).

    warm-up (``step < W``):  m = (step + 1) / (W + 1)
    then ``lr_decay=constant``: m = 1
         ``lr_decay=cosine``:   m = r + (1 - r) * (1 + cos(pi * p)) / 2
         ``lr_decay=linear``:   m = r + (1 - r) * (1 - p)
    with ``p = min(1, (step - W) / (T - W))``,
    ``W = lr_warmup_steps``, ``T = total_steps`` and ``r = min_lr_ratio`` (the floor reached at T).
    """
    warmup = max(int(trainer_cfg.lr_warmup_steps), 0)
    total = max(int(trainer_cfg.total_steps), 1)
    floor = float(trainer_cfg.min_lr_ratio)
    decay = trainer_cfg.lr_decay

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if decay == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(total - warmup, 1))
        if decay == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier
