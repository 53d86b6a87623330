"""Typed configs for in-process tests of the core, composed from the real ``conf/`` tree."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import relax_launch.cli  # also registers the structured-config schema with Hydra
from relax_core.config.schema import RelaxConfig


def compose_config(overrides: list[str], output_dir: str | Path = ".") -> RelaxConfig:
    """The typed config ``python -m relax_launch <overrides>`` would run with."""
    from hydra import compose, initialize_config_module

    with initialize_config_module("relax_launch.conf", version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    cfg.output_dir = str(output_dir)
    return OmegaConf.to_object(cfg)


@functools.cache
def _typed_once(overrides: tuple[str, ...]) -> RelaxConfig:
    return OmegaConf.to_object(relax_launch.cli.compose_config(list(overrides)))


def typed_config(*overrides: str) -> RelaxConfig:
    """The typed config ``python -m relax_launch <overrides>`` runs with, composed once per session for the
    tests that ask for the same one (a fresh copy each time: tests change it)."""
    return copy.deepcopy(_typed_once(overrides))


@pytest.fixture
def make_cfg(tmp_path: Path) -> Callable[..., RelaxConfig]:
    """``make_cfg(*overrides)``: a small, fast config writing under the test's tmp dir."""

    def make(*overrides: str) -> RelaxConfig:
        base = [
            "rollout.batch_size=4",
            "rollout.n_samples_per_prompt=4",
            "rollout.num_threads=1",
            "trainer.num_threads=1",
            "trainer.micro_batch_size=8",
            "trainer.lr_decay=constant",
            "data.num_train=64",
            "data.num_eval=8",
        ]
        return compose_config([*base, *overrides], tmp_path)

    return make
