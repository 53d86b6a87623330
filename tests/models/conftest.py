"""Tiny multimodal twins built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relax_models.tiny_multimodal import build_tiny

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        family: build_tiny(family, root / family, seed=3)
        for family in ("qwen3_moe", "qwen3_vl", "qwen3_vl_moe", "qwen3_omni")
    }
