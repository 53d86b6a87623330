"""``mode.max_staleness=0`` is colocate's step: the async Rollout draws the same tokens as colocate's."""

from __future__ import annotations

from pathlib import Path

import torch

from relax_core.data.prompts import generate_synthetic, load_prompts
from relax_core.databus import InMemoryDataBus, partition_name
from relax_core.databus.records import SAMPLE_FIELDS
from relax_core.roles.rollout import Rollout
from relax_models.loader import load_tokenizer
from tests.core.conftest import compose_config


def test_rollout_at_staleness_zero_draws_colocates_tokens_whatever_the_chunk_size(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The engine samples a call's rows from one random stream, so two chunks of 2 prompts draw other tokens
    than one call of 4: at staleness 0 the async Rollout writes the step in one call, as colocate makes it."""
    overrides = ["mode=async", "mode.max_staleness=0", "mode.rollout_chunk_prompts=2"]
    cfg = compose_config([*overrides, "rollout.batch_size=4", "rollout.n_samples_per_prompt=4"], tmp_path)
    train_path, _ = generate_synthetic(cfg.data, tmp_path / "data", seed=3)
    prompts = load_prompts(train_path, cfg.data, load_tokenizer(str(tiny_model_dir)))[0][:4]
    colocate, streamed, bus = Rollout(cfg, str(tiny_model_dir)), None, InMemoryDataBus()
    try:
        samples = colocate.generate(prompts)  # colocate's step: one call for the batch
        streamed = Rollout(cfg, str(tiny_model_dir), bus=bus)
        streamed.produce(1, prompts, [0, 1, 2, 3])
    finally:
        colocate.shutdown()
        if streamed is not None:
            streamed.shutdown()
    rows = bus.get(partition_name(1), bus.ready(partition_name(1), SAMPLE_FIELDS), ["response_ids"])
    assert [torch.as_tensor(r).tolist() for r in rows["response_ids"]] == [s.response_ids for s in samples]


def test_chunks_per_engine_call() -> None:
    """Prompts per engine call: one call at staleness 0; else the configured chunk, whose default is 4 for
    single-turn generation and the whole step for episodes (each chunk would wait on its slowest tool)."""
    from types import SimpleNamespace

    from relax_core.databus.stages import BusProducer

    def chunk(max_staleness: int, configured: int | None, episodes: bool) -> int:
        producer = BusProducer()
        producer.cfg = SimpleNamespace(
            mode=SimpleNamespace(max_staleness=max_staleness, rollout_chunk_prompts=configured)
        )
        producer.plays_episodes = episodes
        return producer.chunk_prompts(16)

    assert [chunk(0, c, e) for c in (None, 2) for e in (False, True)] == [16] * 4
    assert [chunk(1, None, False), chunk(1, None, True)] == [4, 16]
    assert [chunk(1, 2, True), chunk(1, 0, False)] == [2, 16]
