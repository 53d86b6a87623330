"""Tiny-model dimensions shared by the tests, all derived from ``relax_core.config.schema.TinyModelSpec``.

Imported by name (``from tiny_dims import ...``): pytest puts this folder, tests/conftest.py's, on sys.path.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from relax_core.config.schema import TinyModelSpec


def tiny_dims(**overrides: Any) -> dict[str, Any]:
    """Qwen3Config overrides of the default tiny model (``conf/model/tiny_qwen3.yaml``), changed by
    ``overrides`` (any Qwen3Config field); the multimodal tower entries, null here, are left out."""
    dims = {k: v for k, v in dataclasses.asdict(TinyModelSpec()).items() if v is not None}
    return {**dims, **overrides}


# the 64-wide, 2-layer variant the unit tests of agentic, multimodal and megatron build (quicker to load)
SMALL_DIMS = tiny_dims(hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16)
