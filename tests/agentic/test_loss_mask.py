"""Observation tokens (loss mask 0) contribute nothing to training, in every term and aggregation."""

from __future__ import annotations

import pytest
import torch

from relax_core.agentic.warmstart import expert_samples
from relax_core.algorithms.masked import masked_mean
from relax_core.algorithms.objective import micro_batch_weight, policy_objective
from relax_core.config.schema import AlgorithmConfig, ModelConfig, TrainerConfig
from relax_core.samples import TrainBatch
from tests.agentic.conftest import calc_prompts, rollout_cfg

AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def multi_turn_batch(tokenizer, rewards: list[float]) -> TrainBatch:
    """Expert calculator episodes (turn, observation, turn) with the given rewards, as the trainer sees them."""
    samples = expert_samples(
        calc_prompts(tokenizer, len(rewards)),
        rollout_cfg("relax_core.agentic.envs.CalculatorEnv"),
        tokenizer,
        0,
    )
    for s, r in zip(samples, rewards):
        s.reward, s.group_id = r, 0
    batch = TrainBatch.from_samples(samples, tokenizer.pad_token_id)
    assert 0 < batch.loss_mask.sum() < (batch.loss_mask.shape[1] * len(batch)), "batch has masked tokens"
    return batch


def algo(agg: str) -> AlgorithmConfig:
    return AlgorithmConfig(loss_agg_mode=agg, entropy_coef=0.1, kl_loss_coef=0.1, clip_c=3.0)


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_objective_has_zero_gradient_on_masked_positions(tokenizer, agg):
    batch = multi_turn_batch(tokenizer, [1.0, 0.0, 0.5])
    shape = batch.loss_mask.shape
    g = torch.Generator().manual_seed(0)
    logprobs = (-torch.rand(shape, generator=g)).requires_grad_()
    entropy = torch.rand(shape, generator=g).requires_grad_()
    batch.extras["advantages"] = torch.randn(shape, generator=g)
    batch.extras["old_logprobs"] = logprobs.detach() + 0.1 * torch.randn(shape, generator=g)
    batch.extras["ref_logprobs"] = -torch.rand(shape, generator=g)
    loss, _ = policy_objective(batch, logprobs, entropy, algo(agg))
    loss.backward()
    masked = batch.loss_mask == 0
    assert logprobs.grad[~masked].abs().sum() > 0 and entropy.grad[~masked].abs().sum() > 0
    assert (logprobs.grad[masked] == 0).all() and (entropy.grad[masked] == 0).all()


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_model_gradient_ignores_what_is_written_at_observation_positions(tiny_path, tokenizer, agg):
    """Through the real backend: garbage advantages / old / ref log-probs at observation positions leave
    every parameter gradient unchanged, while the same change at a model token changes it."""
    from relax_core.backends.torch_backend import TorchBackend

    torch.manual_seed(0)
    batch = multi_turn_batch(tokenizer, [1.0, 0.0, 0.5, 0.0])
    backend = TorchBackend(tiny_path, TrainerConfig(), ModelConfig())
    cfg = algo(agg)
    shape = batch.loss_mask.shape
    base_lp = backend.forward_logprobs(batch)
    batch.extras |= {
        "advantages": torch.randn(shape),
        "old_logprobs": base_lp + 0.05 * torch.randn(shape),
        "ref_logprobs": base_lp + 0.05 * torch.randn(shape),
    }

    def grads(b: TrainBatch) -> torch.Tensor:
        backend.model.zero_grad(set_to_none=True)
        total_tokens, total_seqs = float(b.loss_mask.sum()), len(b)
        for micro in b.micro_batches(2):  # accumulation across micro-batches, as the Actor does
            lp, ent = backend._logprobs_entropy(micro)
            w = micro_batch_weight(micro, total_tokens, total_seqs, cfg)
            policy_objective(micro, lp, ent, cfg, w)[0].backward()
        return torch.cat([p.grad.flatten() for p in backend.model.parameters() if p.grad is not None])

    reference = grads(batch)
    masked = (batch.loss_mask == 0) & (torch.arange(shape[1]) < batch.response_lens.unsqueeze(1))
    assert masked.any()
    poisoned = batch.select(list(range(len(batch))))
    for key in ("advantages", "old_logprobs", "ref_logprobs"):
        poisoned.extras[key] = torch.where(masked, torch.full(shape, 50.0), batch.extras[key])
    assert torch.allclose(grads(poisoned), reference, atol=1e-6, rtol=1e-5)

    trained = batch.select(list(range(len(batch))))
    trained.extras["advantages"] = torch.where(batch.loss_mask > 0, 50.0, batch.extras["advantages"])
    assert not torch.allclose(grads(trained), reference, atol=1e-4)


def test_warm_start_nll_counts_agent_tokens_only(tokenizer):
    batch = multi_turn_batch(tokenizer, [0.0, 0.0])
    logprobs = torch.zeros(batch.loss_mask.shape, requires_grad=True)
    (-masked_mean(logprobs, batch.loss_mask)).backward()  # the Actor's sft_step loss
    assert (logprobs.grad[batch.loss_mask == 0] == 0).all()
    assert (logprobs.grad[batch.loss_mask == 1] < 0).all()


def test_trainer_rescores_multi_turn_samples_like_the_engine(tiny_path, tokenizer, engine):
    """The trainer's log-probs of the model's tokens, in context with observations, equal the sampling
    log-probs (so PPO ratios start at 1 and masks line up with tokens)."""
    from relax_core.agentic import MultiTurnRunner
    from relax_core.backends.torch_backend import TorchBackend
    from relax_core.engines.base import SamplingParams

    cfg = rollout_cfg(
        "tests.agentic.envs_fixture.EchoEnv", max_turns=3, max_new_tokens=6, max_context_len=200
    )
    samples = MultiTurnRunner(cfg, tokenizer).generate(
        engine, calc_prompts(tokenizer, 3), SamplingParams(max_new_tokens=6, n=2)
    )
    batch = TrainBatch.from_samples(samples, tokenizer.pad_token_id)
    scorer = TorchBackend(tiny_path, TrainerConfig(), ModelConfig(), trainable=False)
    diff = (scorer.forward_logprobs(batch) - batch.rollout_logprobs).abs() * batch.loss_mask
    assert batch.loss_mask.sum() > 0 and float(diff.max()) < 1e-4
