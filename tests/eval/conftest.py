"""Typed configs composed from the real ``conf/`` tree, small enough for in-process evaluation tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import relax_launch.cli  # noqa: F401  (registers the structured-config schema with Hydra)
from relax_core.config.schema import RelaxConfig


@pytest.fixture
def make_cfg(tmp_path: Path) -> Callable[..., RelaxConfig]:
    """``make_cfg(*overrides)``: the typed config ``python -m relax_launch <overrides>`` would run with."""
    from hydra import compose, initialize_config_module

    def make(*overrides: str) -> RelaxConfig:
        base = ["rollout.num_threads=1", "trainer.num_threads=1", "data.num_train=16", "data.num_eval=6"]
        with initialize_config_module("relax_launch.conf", version_base="1.3"):
            cfg = compose("config", overrides=[*base, *overrides])
        cfg.output_dir = str(tmp_path)
        return OmegaConf.to_object(cfg)

    return make
