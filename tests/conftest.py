"""Session-wide test setup: quiet, offline, single-threaded torch, and one tiny model folder for everyone.

Area-specific fixtures live in ``tests/<area>/conftest.py``; keep this file small.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from relax_core.config import TinyModelSpec

# offline and quiet in this process and every subprocess / Ray worker it starts
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
# the shared 2-core machine: one intra-op thread keeps tests from fighting each other
torch.set_num_threads(1)

# the dimensions of conf/model/tiny_qwen3.yaml (the schema defaults)
TINY_DIMS = {k: v for k, v in dataclasses.asdict(TinyModelSpec()).items() if v is not None}


@pytest.fixture(scope="session")
def tiny_dims() -> dict:
    """Qwen3Config overrides of the default tiny model (``conf/model/tiny_qwen3.yaml``)."""
    return dict(TINY_DIMS)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init tiny Qwen3 + char tokenizer folder, built once (read-only for tests)."""
    from relax_models.tiny import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"), seed=7, **TINY_DIMS)


@pytest.fixture(autouse=True, scope="module")
def _ray_down_after_module():
    """Each test module starts from no Ray: a module that leaves one running must not break the next."""
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()
