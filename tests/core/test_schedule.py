"""trainer.lr_decay=linear: TRL's / HF Trainer's default schedule, with Relax's floor and warm-up."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

import relax_launch.cli  # noqa: F401  (registers the schema)
from relax_core.backends.schedule import lr_multiplier
from relax_core.config.schema import TrainerConfig
from relax_core.errors import RelaxUserError
from relax_core.preflight.validation import validate


def test_linear_decay_to_zero_without_warm_up_matches_trl_default() -> None:
    m = lr_multiplier(TrainerConfig(total_steps=4, lr_decay="linear", min_lr_ratio=0.0))
    # (T - s) / T with T = 4, then 0 after total_steps
    assert [m(s) for s in range(6)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0, 0.0])


def test_linear_decay_after_warm_up_to_the_floor() -> None:
    m = lr_multiplier(TrainerConfig(lr_warmup_steps=2, total_steps=10, lr_decay="linear", min_lr_ratio=0.2))
    # warm-up (s+1)/(W+1); then 0.2 + 0.8·(1 - (s-2)/8)
    assert [m(0), m(1), m(2), m(6), m(10), m(30)] == pytest.approx([1 / 3, 2 / 3, 1.0, 0.6, 0.2, 0.2])


def test_linear_decay_drives_the_optimizer_lr() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    cfg = TrainerConfig(total_steps=5, lr_decay="linear", min_lr_ratio=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(cfg))
    lrs = []
    for _ in range(5):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([1e-3, 8e-4, 6e-4, 4e-4, 2e-4])


@pytest.mark.parametrize(("decay", "accepted"), [("linear", True), ("cosine", True), ("step", False)])
def test_validation_accepts_linear_and_names_the_key_otherwise(decay: str, accepted: bool) -> None:
    with initialize_config_module("relax_launch.conf", version_base="1.3"):
        cfg = OmegaConf.to_object(compose("config", overrides=[f"trainer.lr_decay={decay}"]))
    if accepted:
        validate(cfg)
    else:
        with pytest.raises(RelaxUserError, match="trainer.lr_decay='step' is not one of"):
            validate(cfg)
