"""Token-budget micro-batches packed without padding train the same loss and gradients as padded ones."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from relax_core.algorithms.objective import micro_batch_weight, policy_objective, sequence_count
from relax_core.backends.base import token_budget_groups
from relax_core.backends.torch_backend import TorchBackend
from relax_core.config.schema import AlgorithmConfig, ModelConfig, TrainerConfig
from relax_core.errors import RelaxUserError
from relax_core.samples import Sample, TrainBatch

TRAINER = TrainerConfig(lr=1e-3, lr_decay="constant", grad_clip=1e6, share_prompts=False)


def varied_batch(vocab: int) -> TrainBatch:
    """9 rows, prompts 2-9 and responses 1-23 tokens (a long tail), some tokens masked."""
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i, (p, r) in enumerate([(4, 3), (9, 23), (2, 1), (6, 5), (3, 12), (7, 2), (5, 4), (8, 7), (2, 2)]):
        ids = torch.randint(3, vocab, (p + r,), generator=gen).tolist()
        mask = [0 if (i % 3 == 1 and j == 0) else 1 for j in range(r)]
        samples.append(Sample(i // 3, i % 3, ids[:p], ids[p:], [-1.0] * r, mask, reward=float(i % 2)))
    batch = TrainBatch.from_samples(samples, pad_token_id=0)
    batch.extras["advantages"] = torch.linspace(-1.0, 1.2, len(batch)).unsqueeze(1) * batch.loss_mask
    return batch


def step(backend: TorchBackend, batch: TrainBatch, algo: AlgorithmConfig) -> dict[str, float]:
    total_tokens, total_seqs = float(batch.loss_mask.sum()), sequence_count(batch, algo)

    def loss_fn(mb, logprobs, entropy):
        return policy_objective(
            mb, logprobs, entropy, algo, micro_batch_weight(mb, total_tokens, total_seqs, algo)
        )

    return backend.train_step(batch, loss_fn, 4)


def test_token_budget_groups_first_fit_longest_first() -> None:
    assert token_budget_groups([5, 30, 12, 7, 3], 20) == [[1], [2, 3], [0, 4]]
    groups = token_budget_groups([40, 1, 1, 25, 9], 32)
    assert sorted(r for g in groups for r in g) == [0, 1, 2, 3, 4] and [0] in groups  # too long: alone
    assert all(sum([40, 1, 1, 25, 9][r] for r in g) <= 32 for g in groups if g != [0])


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_packed_matches_padded_logprobs_loss_and_gradients(tiny_model_dir: Path, agg: str) -> None:
    algo = AlgorithmConfig(loss_agg_mode=agg, entropy_coef=0.01)
    padded = TorchBackend(str(tiny_model_dir), TRAINER, ModelConfig(), temperature=0.7)
    packed_cfg = replace(TRAINER, max_tokens_per_micro_batch=40)
    packed = TorchBackend(str(tiny_model_dir), packed_cfg, ModelConfig(), temperature=0.7)
    batch = varied_batch(padded.model.config.vocab_size)
    # forward_logprobs puts rows grouped out of order back in batch order
    lp_padded, lp_packed = padded.forward_logprobs(batch, 4), packed.forward_logprobs(batch, 4)
    assert lp_padded.shape == lp_packed.shape and lp_padded.abs().sum() > 0
    torch.testing.assert_close(lp_packed, lp_padded, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        ent = padded._logprobs_entropy(batch)[1], packed._packed_logprobs_entropy(batch)[1]
    torch.testing.assert_close(ent[1], ent[0], atol=1e-5, rtol=1e-5)
    rows_per_forward: list[int] = []
    packed.model.register_forward_pre_hook(
        lambda _m, _a, kw: rows_per_forward.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    m_padded, m_packed = step(padded, batch, algo), step(packed, batch, algo)
    assert len(rows_per_forward) >= 3 and set(rows_per_forward) == {1}  # 105 tokens, 40 a micro-batch: packed
    assert m_packed["loss"] == pytest.approx(m_padded["loss"], rel=1e-5)
    assert m_packed["grad_norm"] == pytest.approx(m_padded["grad_norm"], rel=1e-4)
    named = zip(padded.model.named_parameters(), packed.model.parameters(), strict=True)
    for (name, p_padded), p_packed in named:
        assert torch.allclose(p_packed.grad, p_padded.grad, atol=1e-6, rtol=1e-4), name


@pytest.mark.parametrize("override", ["trainer.max_tokens_per_micro_batch=0", "trainer=megatron"])
def test_token_budget_refused_where_it_does_not_apply(make_cfg, override: str) -> None:
    from relax_core.preflight.validation import validate

    cfg = make_cfg("trainer.max_tokens_per_micro_batch=512", override)
    with pytest.raises(RelaxUserError, match="trainer.max_tokens_per_micro_batch=.*set it to null"):
        validate(cfg)
