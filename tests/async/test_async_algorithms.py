"""Algorithms with extra roles or sampling rules in ``mode=async``: PPO (Critic), on-policy distillation
(Teacher) and DAPO (dynamic sampling), a few steps each in one module-scoped Ray."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from relax_core.databus import InMemoryDataBus, partition_name
from relax_core.databus.records import SAMPLE_FIELDS
from relax_core.roles.rollout import Rollout
from relax_core.samples import PromptRecord
from relax_launch.cli import CONFIG_MODULE
from relax_models.loader import load_tokenizer
from relax_models.tiny import build_tiny_qwen3

SMALL = [
    "mode=async",
    "mode.max_staleness=1",
    "mode.rollout_chunk_prompts=2",
    "rollout.batch_size=4",
    "rollout.n_samples_per_prompt=4",
    "rollout.num_threads=1",
    "trainer.num_threads=1",
    "trainer.micro_batch_size=16",
    "trainer.sft_warmup_steps=2",
    "trainer.sft_batch_size=16",
    "trainer.eval_every=0",
    "trainer.export_final_model=false",
    "data.num_train=128",
    "data.num_eval=8",
    "logger=jsonl",
    "logger.plot=false",
]


def compose_cfg(out_dir, *overrides: str):
    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        cfg = compose("config", overrides=[*SMALL, *overrides])
    cfg.output_dir = str(out_dir)
    return cfg


def run_async(out_dir, *overrides: str) -> tuple[dict, list[dict]]:
    from relax_core.preflight.validation import validate
    from relax_core.run_loop import RunLoop

    cfg = compose_cfg(out_dir, *overrides)
    config = OmegaConf.to_object(cfg)
    validate(config)
    loop = RunLoop(config, OmegaConf.to_container(cfg, resolve=True))
    summary = loop.run()
    return summary, [m for m in loop.sink.history if m.get("step", 0) > 0]


@pytest.mark.slow
def test_ppo_critic_writes_values_and_trains_in_async(ray_cluster, tmp_path) -> None:
    summary, steps = run_async(
        tmp_path, "algorithm=ppo", "algorithm.critic.warmup_steps=1", "trainer.total_steps=3"
    )
    assert summary["status"] == "finished" and [m["step"] for m in steps] == [1, 2, 3]
    assert steps[0]["actor_frozen"] == 1.0 and steps[0]["optimizer_steps"] == 0  # critic warm-up
    assert [m["optimizer_steps"] for m in steps[1:]] == [1.0, 1.0]
    for m in steps:
        assert m["critic/vf_loss"] >= 0 and "time/critic_wait_s" in m
    assert steps[0]["critic/values_mean"] == 0.0  # the zero-initialised value head, before any fit


@pytest.mark.slow
def test_on_policy_distillation_teacher_runs_in_async(ray_cluster, tmp_path) -> None:
    cache = tmp_path / "cache"
    summary, steps = run_async(
        tmp_path / "run",
        "algorithm=opd",
        f"algorithm.teacher.cache_dir={cache}",
        "algorithm.teacher.train_steps=20",
        "algorithm.teacher.teacher_only=true",  # advantages come from the teacher's log-probs alone
        "trainer.total_steps=2",
    )
    assert summary["status"] == "finished" and len(steps) == 2
    for m in steps:
        assert "time/teacher_wait_s" in m and m["loss"] != 0.0


@pytest.mark.slow
def test_dapo_dynamic_sampling_in_async(ray_cluster, tmp_path) -> None:
    summary, steps = run_async(tmp_path, "algorithm=dapo", "trainer.total_steps=2")
    assert summary["status"] == "finished" and len(steps) == 2
    for m in steps:
        assert 1 <= m["dynamic_sampling/gen_batches"] <= 4
        assert 0 <= m["dynamic_sampling/kept_group_frac"] <= 1


def test_dynamic_sampling_rollout_fills_slots_with_spread_groups_or_masked_filler(tmp_path) -> None:
    """Top-1 sampling gives every group n equal samples (no spread): a non-final round writes nothing,
    the final round fills the step's slots with those groups, loss mask zeroed."""
    model = build_tiny_qwen3(tmp_path / "tiny", seed=0, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip
    cfg = OmegaConf.to_object(
        compose_cfg(tmp_path, "algorithm=dapo", "rollout.top_k=1", "algorithm.overlong_buffer=0")
    )
    bus = InMemoryDataBus()
    rollout = Rollout(cfg, str(model), bus=bus)
    tok = load_tokenizer(str(model))
    prompts = [PromptRecord(i, tok(f"sort {i}3:").input_ids, f"sort {i}3:", label="3") for i in range(3)]
    first = rollout.produce(1, prompts, [5, 6, 7], last_round=False)
    assert first.filled == [] and first.kept_groups == 0 and bus.partitions() == []
    last = rollout.produce(1, prompts, [6, 7], last_round=True)
    assert last.filled == [6, 7] and last.kept_groups == 0
    keys = bus.ready(partition_name(1), SAMPLE_FIELDS)
    assert keys == [f"{p:07d}" for p in range(24, 32)]  # slot g holds positions 4g .. 4g+3
    rows = bus.get(partition_name(1), keys, ["loss_mask", "response_ids"])
    assert all(len(r) > 0 for r in rows["response_ids"])
    assert all(float(torch.as_tensor(m).sum()) == 0.0 for m in rows["loss_mask"])
