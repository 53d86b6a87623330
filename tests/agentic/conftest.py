"""Shared fixtures: the tiny Qwen3 (random init, char tokenizer) and a real torch rollout engine on it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tiny_dims import SMALL_DIMS

from relax_core.config.schema import DataConfig, RolloutConfig
from relax_core.samples import PromptRecord

TINY = {**SMALL_DIMS, "tie_word_embeddings": False}


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory) -> str:
    from relax_models.tiny import build_tiny_qwen3

    return str(build_tiny_qwen3(Path(tmp_path_factory.mktemp("tiny")), seed=3, **TINY))


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    from relax_models.loader import load_tokenizer

    return load_tokenizer(tiny_path)


@pytest.fixture(scope="session")
def engine(tiny_path, tokenizer):
    from relax_core.engines.torch_engine import TorchEngine
    from relax_models.loader import load_causal_lm

    return TorchEngine(load_causal_lm(tiny_path), tokenizer.pad_token_id, [tokenizer.eos_token_id], seed=0)


def rollout_cfg(target: str, **kw) -> RolloutConfig:
    base = dict(max_turns=3, max_new_tokens=12, max_context_len=64, env_step_timeout_s=5.0)
    return RolloutConfig(env={"_target_": target}, **(base | kw))


def calc_prompts(tokenizer, n: int, seed: int = 0) -> list[PromptRecord]:
    from relax_core.agentic.tasks import calc_row

    rng, cfg = random.Random(seed), DataConfig(min_digits=2, max_digits=2)
    rows = [calc_row(rng, cfg) for _ in range(n)]
    return [
        PromptRecord(i, tokenizer(r["prompt"]).input_ids, r["prompt"], r["label"], r["metadata"])
        for i, r in enumerate(rows)
    ]
