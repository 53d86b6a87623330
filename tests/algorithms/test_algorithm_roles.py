"""Critic, Teacher, Advantages and DAPO sampling in-process on real tiny models (no Ray needed)."""

from __future__ import annotations

import json

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from relax_core.algorithms.sampling_rules import collect_with_dynamic_sampling, critic_warming_up
from relax_core.config.schema import DataConfig, TeacherConfig
from relax_core.errors import RelaxUserError
from relax_core.roles.advantages import Advantages
from relax_core.roles.critic import Critic
from relax_core.roles.teacher import Teacher, check_tokenizer_match, ensure_default_teacher
from relax_core.samples import PromptRecord, Sample, TrainBatch
from relax_launch.cli import CONFIG_MODULE
from relax_models.tiny import build_tiny_qwen3
from relax_models.tokenizer import build_char_tokenizer

DIMS = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=64,
)


def typed(*overrides: str):
    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        return OmegaConf.to_object(compose("config", overrides=list(overrides)))


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(build_tiny_qwen3(tmp_path_factory.mktemp("tiny"), seed=0, **DIMS))


def make_batch(rewards: list[float], lengths: list[int], groups: list[int]) -> TrainBatch:
    samples = [
        Sample(g, i, [10, 11, 12], [13 + (j % 5) for j in range(n)], [-1.0] * n, [1] * n, reward=r)
        for i, (r, n, g) in enumerate(zip(rewards, lengths, groups, strict=True))
    ]
    return TrainBatch.from_samples(samples, pad_token_id=0)


def test_critic_values_and_training_reduce_value_loss(tiny_path):
    cfg = typed("algorithm=ppo", "algorithm.critic.lr=0.01", "algorithm.critic.value_clip=null")
    critic = Critic(cfg, tiny_path)
    batch = make_batch([1.0, 0.0, 0.5], [3, 1, 2], [0, 0, 1])
    values = critic.compute_values(batch)
    assert values.shape == batch.loss_mask.shape
    assert torch.equal(values, torch.zeros_like(values))  # zero-initialised head: V = 0 at the start
    returns = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.0]]) * batch.loss_mask
    batch.extras["returns"] = returns
    losses = []
    for _ in range(15):
        batch.extras["values"] = critic.compute_values(batch)
        losses.append(critic.train(batch)["critic/vf_loss"])
    assert losses[-1] < 0.5 * losses[0]
    final = critic.compute_values(batch)
    assert float(final[1, 1:].abs().sum()) == 0.0  # masked positions never carry a value


def test_default_teacher_is_built_once_and_scores_tokens(tmp_path, tiny_path):
    teacher_cfg = TeacherConfig(hidden_size=32, num_hidden_layers=1, train_steps=3, train_batch_size=8)
    folder = ensure_default_teacher(teacher_cfg, DataConfig(), seed=0, folder=tmp_path / "teacher")
    marker = json.loads((folder / "relax_teacher.json").read_text())
    assert marker["recipe"]["train_steps"] == 3 and 0.0 <= marker["greedy_accuracy"] <= 1.0
    stamp = (folder / "relax_teacher.json").stat().st_mtime_ns
    assert ensure_default_teacher(teacher_cfg, DataConfig(), seed=0, folder=folder) == folder
    assert (folder / "relax_teacher.json").stat().st_mtime_ns == stamp  # reused, not retrained
    check_tokenizer_match(tiny_path, str(folder))  # same char tokenizer as the student
    cfg = typed("algorithm=opd")
    teacher = Teacher(cfg, str(folder))
    batch = make_batch([1.0, 0.0], [3, 2], [0, 0])
    logprobs = teacher.compute_log_probs(batch)
    assert logprobs.shape == batch.loss_mask.shape
    assert bool((logprobs[batch.loss_mask > 0] < 0).all())
    assert float(logprobs[1, 2]) == 0.0


def test_teacher_with_another_vocabulary_is_refused(tmp_path, tiny_path):
    build_char_tokenizer("0123456789").save_pretrained(tmp_path / "other")
    with pytest.raises(RelaxUserError, match="tokenizer differs"):
        check_tokenizer_match(tiny_path, str(tmp_path / "other"))


def test_teacher_path_must_be_a_model_folder(tmp_path):
    from relax_core.roles.teacher import resolve_teacher_path

    cfg = typed("algorithm=opd", f"algorithm.teacher.path={tmp_path}")
    with pytest.raises(RelaxUserError, match="not a model folder"):
        resolve_teacher_path(cfg)


def test_advantages_role_opd_and_reward_side_kl():
    batch = make_batch([1.0, 0.0], [2, 2], [0, 0])
    batch.extras["teacher_logprobs"] = torch.tensor([[-0.5, -1.0], [-3.0, -1.0]])
    # student (rollout) log-probs are -1 everywhere: A -= coef·(-1 - log p_teacher)
    cfg = typed("algorithm=opd", "algorithm.teacher.coef=1.0")
    adv = Advantages(cfg).compute(batch)
    base = 1.0 / (2**0.5 + 1e-6)  # GRPO: (1 - 0.5) / std(1, 0)
    assert torch.allclose(adv, torch.tensor([[base + 0.5, base], [-base - 2.0, -base]]), atol=1e-5)
    only = Advantages(typed("algorithm=opd", "algorithm.teacher.teacher_only=true")).compute(batch)
    assert torch.allclose(only, torch.tensor([[0.5, 0.0], [-2.0, 0.0]]))
    # reinforce_pp: k1(log π_old, log π_ref) per token lowers the return of the penalised row
    rpp = Advantages(typed("algorithm=reinforce_pp", "algorithm.kl_reward_coef=1.0"))
    no_kl = rpp.compute(batch)
    batch.extras["ref_logprobs"] = torch.tensor([[-2.0, -2.0], [-1.0, -1.0]])  # row 0: kl = +1 per token
    with_kl = rpp.compute(batch)
    assert float(with_kl[0, 0]) < float(no_kl[0, 0])


def test_dynamic_sampling_refills_with_groups_that_have_signal():
    cfg = typed("algorithm=dapo", "rollout.batch_size=2", "rollout.n_samples_per_prompt=2")
    # rounds of (group id -> (rewards, response lengths)); lengths near max_new_tokens=8 get penalised
    rounds = iter(
        [
            {0: ([1.0, 1.0], [3, 3]), 1: ([0.0, 1.0], [3, 3])},
            {2: ([0.0, 0.0], [3, 3]), 3: ([0.5, 0.5], [3, 7])},  # group 3 differs only by the penalty
        ]
    )
    calls = []

    def generate(prompts):
        spec = next(rounds)
        calls.append(len(prompts))
        return [
            Sample(g, i, [1], [2] * n, [0.0] * n, [1] * n, reward=r)
            for g, (rs, ns) in spec.items()
            for i, (r, n) in enumerate(zip(rs, ns, strict=True))
        ]

    prompts = [PromptRecord(0, [1], "p"), PromptRecord(1, [1], "q")]
    samples, m = collect_with_dynamic_sampling(lambda: generate(prompts), cfg.algorithm, 2, 8)
    assert calls == [2, 2]
    assert sorted({s.group_id for s in samples}) == [1, 3]
    penalised = [s for s in samples if s.group_id == 3 and len(s.response_ids) == 7][0]
    assert (
        penalised.reward == pytest.approx(0.5 - 0.5) and penalised.reward_extras["overlong_penalty"] == -0.5
    )
    assert m["dynamic_sampling/gen_batches"] == 2.0
    assert m["dynamic_sampling/kept_group_frac"] == pytest.approx(0.5)


def test_critic_warmup_freezes_actor_for_the_configured_steps():
    cfg = typed("algorithm=ppo", "algorithm.critic.warmup_steps=2")
    frozen = [critic_warming_up(cfg.algorithm, step) for step in range(1, 5)]
    assert frozen == [True, True, False, False]
