"""Engine fixtures: the tiny Qwen3 as a TorchEngine, and a live SGLang-compatible server around one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_helpers import make_engine

from relax_core.engines.http_server import ServerThread, create_app
from relax_core.engines.torch_engine import TorchEngine


@pytest.fixture
def server(tiny_model_dir: Path, tokenizer) -> Iterator[tuple[str, TorchEngine]]:
    """Our engine behind real HTTP on a free 127.0.0.1 port."""
    engine = make_engine(tiny_model_dir, tokenizer, seed=3)
    app = create_app(engine, tokenizer, str(tiny_model_dir))
    srv = ServerThread(app)
    yield srv.url, engine
    app.state.loop.stop()
    srv.stop()
