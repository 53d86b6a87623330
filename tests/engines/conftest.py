"""Engine fixtures: the tiny Qwen3 as a TorchEngine, and a live SGLang-compatible server around one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from engine_helpers import make_engine

from relax_core.engines.http_server import ServerThread, create_app
from relax_core.engines.torch_engine import TorchEngine
from relax_models.loader import load_causal_lm, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> torch.nn.Module:
    return load_causal_lm(str(tiny_model_dir)).eval()


@pytest.fixture
def server(tiny_model_dir: Path, tokenizer) -> Iterator[tuple[str, TorchEngine]]:
    """Our engine behind real HTTP on a free 127.0.0.1 port."""
    engine = make_engine(tiny_model_dir, tokenizer, seed=3)
    app = create_app(engine, tokenizer, str(tiny_model_dir))
    srv = ServerThread(app)
    yield srv.url, engine
    app.state.loop.stop()
    srv.stop()
