"""Roles in-process, without Ray: they are plain classes (Ray wraps them only in runtime/groups.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relax_core.data.prompts import generate_synthetic, load_prompts
from relax_core.roles.actor import Actor
from relax_core.roles.advantages import Advantages
from relax_core.roles.reference import Reference
from relax_core.roles.rollout import Rollout
from relax_core.samples import Sample, SampleStatus, TrainBatch
from relax_models.loader import load_tokenizer


@pytest.fixture
def cfg(make_cfg):
    return make_cfg("rollout.max_new_tokens=6", "trainer.micro_batch_size=5")


@pytest.fixture
def prompts(cfg, tiny_model_dir: Path, tmp_path: Path):
    train_path, _ = generate_synthetic(cfg.data, tmp_path / "data", seed=3)
    records, _ = load_prompts(train_path, cfg.data, load_tokenizer(str(tiny_model_dir)))
    return records[: cfg.rollout.batch_size]


@pytest.fixture
def rollout(cfg, tiny_model_dir: Path):
    role = Rollout(cfg, str(tiny_model_dir))
    yield role
    role.shutdown()


def scored_batch(rollout: Rollout, prompts, cfg) -> tuple[list[Sample], TrainBatch]:
    samples = rollout.generate(prompts)
    batch = TrainBatch.from_samples(samples, rollout.tokenizer.pad_token_id)
    batch.extras["advantages"] = Advantages(cfg).compute(batch)
    return samples, batch


def test_rollout_generate_returns_scored_groups(rollout: Rollout, prompts, cfg) -> None:
    n = cfg.rollout.n_samples_per_prompt
    samples = rollout.generate(prompts)
    assert len(samples) == len(prompts) * n
    for j, s in enumerate(samples):
        p = prompts[j // n]
        assert (s.group_id, s.index_in_group) == (p.index, j % n)
        assert s.prompt_ids == p.prompt_ids and s.label == p.label
        assert 1 <= len(s.response_ids) <= cfg.rollout.max_new_tokens
        assert len(s.rollout_logprobs) == len(s.loss_mask) == len(s.response_ids)
        assert s.response_text == rollout.tokenizer.decode(s.response_ids, skip_special_tokens=True)
        assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
        assert (s.status is SampleStatus.TRUNCATED) == (
            len(s.response_ids) == cfg.rollout.max_new_tokens
            and s.response_ids[-1] != rollout.tokenizer.eos_token_id
        )
        # the digits reward: per-position credit and exact-match accuracy
        assert 0.0 <= s.reward <= 1.0 and s.reward_extras["acc"] in (0.0, 1.0)
        assert s.reward_extras["reward_error"] == 0.0
    greedy = rollout.generate(prompts, greedy=True)
    assert [s.group_id for s in greedy] == [p.index for p in prompts]
    assert rollout.generate(prompts, greedy=True)[0].response_ids == greedy[0].response_ids


def test_rollout_rewards_match_the_reward_function(rollout: Rollout, prompts) -> None:
    samples = rollout.generate(prompts)
    for s in samples:
        text = s.response_text.strip()
        hits = sum(a == b for a, b in zip(text, s.label))
        assert s.reward == pytest.approx(hits / max(len(s.label), len(text)))
        assert s.reward_extras["acc"] == float(text == s.label)


def test_actor_train_changes_weights_and_returns_metrics(
    rollout: Rollout, prompts, cfg, tiny_model_dir: Path
) -> None:
    samples, batch = scored_batch(rollout, prompts, cfg)
    actor = Actor(cfg, str(tiny_model_dir))
    # the Actor scores the rollout's tokens like the engine did (same weights, same temperature)
    logprobs = actor.compute_log_probs(batch)
    assert torch.allclose(logprobs, batch.rollout_logprobs, atol=1e-4)
    before = actor.state_dict()
    metrics = actor.train(1, batch)
    assert {"loss", "pg_loss", "entropy", "grad_norm", "lr", "optimizer_steps"} <= set(metrics)
    assert metrics["optimizer_steps"] == 1.0 and metrics["grad_norm"] > 0
    after = actor.state_dict()
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # the rollout engine picks the new weights up
    rollout.load_weights(after, version=1)
    assert {s.policy_version for s in rollout.generate(prompts)} == {1}


def test_actor_optimizer_steps_follow_global_batch_and_epochs(
    make_cfg, rollout: Rollout, prompts, tiny_model_dir: Path
) -> None:
    cfg = make_cfg("trainer.global_batch_size=6", "algorithm.ppo_epochs=2")
    _, batch = scored_batch(rollout, prompts, cfg)  # 16 samples -> mini-batches of 6, 6, 4
    batch.extras["old_logprobs"] = batch.rollout_logprobs.clone()
    metrics = Actor(cfg, str(tiny_model_dir)).train(1, batch)
    assert metrics["optimizer_steps"] == 6.0


def test_actor_warm_start_lowers_the_nll(cfg, prompts, tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_model_dir))
    samples = []
    for p in prompts:
        target = tokenizer(p.label, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        samples.append(Sample(p.index, 0, p.prompt_ids, target, [0.0] * len(target), [1] * len(target)))
    batch = TrainBatch.from_samples(samples, tokenizer.pad_token_id)
    actor = Actor(cfg, str(tiny_model_dir))
    losses = [actor.sft_step(batch)["loss"] for _ in range(6)]
    assert losses[-1] < losses[0] - 0.1
    assert actor.backend.optimizer.param_groups[0]["lr"] == pytest.approx(cfg.trainer.sft_lr)
    actor.end_warm_start()
    assert actor.backend.optimizer.param_groups[0]["lr"] == pytest.approx(cfg.trainer.lr)
    assert not actor.backend.optimizer.state  # fresh moments for RL


def test_reference_scores_with_the_initial_policy(
    rollout: Rollout, prompts, cfg, tiny_model_dir: Path
) -> None:
    _, batch = scored_batch(rollout, prompts, cfg)
    actor = Actor(cfg, str(tiny_model_dir))
    reference = Reference(cfg, str(tiny_model_dir))
    initial = actor.compute_log_probs(batch)
    assert torch.allclose(reference.compute_log_probs(batch), initial, atol=1e-6)
    for _ in range(2):
        actor.train(1, batch)
    assert not torch.allclose(actor.compute_log_probs(batch), initial, atol=1e-4)
    # the Reference stays frozen at the initial weights
    assert torch.allclose(reference.compute_log_probs(batch), initial, atol=1e-6)
    assert not any(p.requires_grad for p in reference.backend.model.parameters())


def test_advantages_are_group_normalised(rollout: Rollout, prompts, cfg) -> None:
    samples, batch = scored_batch(rollout, prompts, cfg)
    adv = batch.extras["advantages"]
    assert adv.shape == batch.loss_mask.shape
    for gid in batch.group_ids.unique():
        rows = batch.group_ids == gid
        rewards = batch.rewards[rows]
        expected = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        got = adv[rows][:, 0]  # the sequence advantage on every response token
        assert torch.allclose(got, expected, atol=1e-3)
