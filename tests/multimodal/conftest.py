"""Tiny multimodal twins and synthetic datasets shared by the multimodal tests (built once per session)."""

from __future__ import annotations

import pytest
import torch
from multimodal_twins import TASKS, tiny_model_cfg

from relax_core.config.schema import DataConfig, ModalityConfig
from relax_core.data.prompts import generate_synthetic
from relax_models.loader import resolve_model_path

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def twins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Per family: model folder, data config, modality config and generated train/eval files."""
    root = tmp_path_factory.mktemp("mm_twins")
    out = {}
    for family, (task, modality, keys) in TASKS.items():
        folder = resolve_model_path(tiny_model_cfg(family), str(root / family), seed=3)
        data_cfg = DataConfig(name=task, synthetic=task, num_train=48, num_eval=16)
        train, eval_ = generate_synthetic(data_cfg, root / family / "data", seed=5)
        out[family] = {
            "path": folder,
            "data": data_cfg,
            "modality": ModalityConfig(name=modality, keys=keys),
            "train": train,
            "eval": eval_,
        }
    return out
