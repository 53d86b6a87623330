"""Every algorithm function pinned with hand-computed numbers, edge cases included."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from relax_core.algorithms import ADVANTAGE_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES
from relax_core.algorithms.advantages import (
    discounted_returns,
    distillation_advantages,
    gae,
    last_token_rewards,
)
from relax_core.algorithms.objective import micro_batch_weight, policy_objective, truncated_is_weights
from relax_core.algorithms.shaping import groups_with_spread, overlong_penalty
from relax_core.algorithms.value import clipped_value_loss
from relax_core.config.schema import AlgorithmConfig
from relax_core.samples import Sample, TrainBatch


def cfg(**kw) -> AlgorithmConfig:
    return AlgorithmConfig(**kw)


def t(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float)


# ---------------------------------------------------------------- advantage estimators
def test_grpo_unbiased_std_and_groups_by_id_not_position():
    rewards = torch.tensor([1.0, 0.0, 5.0, 0.0, 5.0])
    groups = torch.tensor([7, 7, 3, 7, 3])  # interleaved ids
    adv = ADVANTAGE_ESTIMATORS.get("grpo")(rewards, groups, torch.ones(5, 1))[:, 0]
    # group 7: rewards 1,0,0 mean 1/3, unbiased std sqrt(((2/3)^2+2(1/3)^2)/2)=sqrt(1/3)
    std7 = math.sqrt(1 / 3)
    assert adv[0] == pytest.approx((2 / 3) / (std7 + 1e-6))
    assert adv[1] == pytest.approx((-1 / 3) / (std7 + 1e-6))
    # group 3: all equal -> 0
    assert adv[2] == 0 and adv[4] == 0


def test_grpo_group_of_one_and_dr_grpo_no_std():
    adv = ADVANTAGE_ESTIMATORS.get("grpo")(torch.tensor([0.7]), torch.tensor([0]), torch.ones(1, 2))
    assert torch.equal(adv, torch.zeros(1, 2))
    dr = ADVANTAGE_ESTIMATORS.get("grpo")(
        torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0, 0, 0]), t([1, 1], [1, 0], [0, 0]), norm_by_std=False
    )
    assert torch.allclose(dr, t([0.5, 0.5], [-0.5, 0.0], [0.0, 0.0]))  # fully masked row stays 0


def test_rloo_leave_one_out():
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0])
    groups = torch.tensor([0, 0, 0, 1])
    adv = ADVANTAGE_ESTIMATORS.get("rloo")(rewards, groups, torch.ones(4, 1))[:, 0]
    # i=0: 1 - (0+0.5)/2 = 0.75; i=1: 0 - 0.75 = -0.75; i=2: 0.5 - 0.5 = 0; group of one -> 0
    assert torch.allclose(adv, torch.tensor([0.75, -0.75, 0.0, 0.0]))


def test_rloo_all_equal_rewards_zero():
    adv = ADVANTAGE_ESTIMATORS.get("rloo")(torch.ones(3), torch.zeros(3, dtype=torch.long), torch.ones(3, 2))
    assert torch.equal(adv, torch.zeros(3, 2))


# every value of the digits reward's partial credit hits/L (responses up to 8 characters)
PARTIAL_CREDITS = sorted({k / n for n in range(1, 9) for k in range(n + 1)})
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
GROUP_BASELINES = [
    ("grpo", {}),
    ("grpo", {"norm_by_std": False}),  # Dr. GRPO
    ("rloo", {}),
    ("reinforce_pp_baseline", {}),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [8, 16, 64])
@pytest.mark.parametrize(("name", "kwargs"), GROUP_BASELINES)
def test_all_equal_groups_get_exactly_zero_advantage(name, kwargs, n, dtype):
    """A group whose n rewards are equal has r − mean_g(r) = 0 and std_g = 0, so A = 0 exactly (float32
    statistics were an ulp off, which the std division blew up to |A| ≈ 0.06 at n = 8, up to 120 in float16)."""
    rewards = torch.tensor(PARTIAL_CREDITS, dtype=dtype).repeat_interleave(n)
    groups = torch.arange(len(PARTIAL_CREDITS)).repeat_interleave(n)
    mask = torch.ones(len(rewards), 3, dtype=dtype)
    adv = ADVANTAGE_ESTIMATORS.get(name)(rewards, groups, mask, **kwargs)
    assert adv.dtype == dtype
    assert torch.equal(adv, torch.zeros_like(adv))


@pytest.mark.parametrize("dtype", DTYPES)
def test_group_baselines_next_to_an_all_equal_group(dtype):
    """Group 0: 1, 0, 0, 1 (mean 1/2, unbiased std sqrt(1/3)); group 1: 0.3 eight times."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0] + [0.3] * 8, dtype=dtype)
    groups = torch.tensor([0] * 4 + [1] * 8)
    mask = torch.ones(12, 1, dtype=dtype)
    sign = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    zeros = torch.zeros(8, dtype=torch.float64)
    expected = {
        ("grpo", True): 0.5 / (math.sqrt(1 / 3) + 1e-6),
        ("grpo", False): 0.5,
        ("rloo", True): 4 / 3 * 0.5,  # 1 − (0 + 0 + 1)/3 = 2/3
    }
    for (name, norm), a in expected.items():
        kwargs = {"norm_by_std": norm} if name == "grpo" else {}
        adv = ADVANTAGE_ESTIMATORS.get(name)(rewards, groups, mask, **kwargs)[:, 0]
        assert adv.dtype == dtype
        assert torch.equal(adv, torch.cat([a * sign, zeros]).to(dtype)), (name, norm)


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_whitening_of_equal_returns_is_exactly_zero(dtype):
    """reinforce_pp (γ = 1: G_t = r on every token) and gae (V = 0, γ = λ = 1: A_t = r) whiten a batch whose
    rewards are all 0.7 to (G − mean)/sqrt(0 + 1e-8) = 0; an ulp off the mean gave 6e-4 (inf in float16)."""
    rewards = torch.full((64,), 0.7, dtype=dtype)
    groups, mask = torch.arange(64), torch.ones(64, 3, dtype=dtype)
    for name, kwargs in [("reinforce_pp", {}), ("gae", {"values": torch.zeros(64, 3, dtype=dtype)})]:
        adv = ADVANTAGE_ESTIMATORS.get(name)(rewards, groups, mask, **kwargs)
        assert adv.dtype == dtype
        assert torch.equal(adv, torch.zeros_like(adv)), name


def test_last_token_rewards_and_discounted_returns():
    mask = t([1, 1, 1], [1, 0, 0], [0, 0, 0])
    tok = last_token_rewards(torch.tensor([2.0, 3.0, 9.0]), mask)
    assert torch.equal(tok, t([0, 0, 2], [3, 0, 0], [0, 0, 0]))
    ret = discounted_returns(tok, mask, gamma=0.5)
    assert torch.allclose(ret, t([0.5, 1.0, 2.0], [3, 0, 0], [0, 0, 0]))


def test_discounted_returns_skip_masked_middle_token():
    # an observation token (mask 0) in the middle neither gets a return nor discounts
    mask = t([1, 0, 1])
    ret = discounted_returns(t([0, 5, 1]), mask, gamma=0.5)
    assert torch.allclose(ret, t([0.5, 0.0, 1.0]))


def test_reinforce_pp_kl_penalty_and_batch_whitening():
    mask = t([1, 1], [1, 1])
    kl = t([1.0, 0.0], [0.0, 0.0])
    adv = ADVANTAGE_ESTIMATORS.get("reinforce_pp")(
        torch.tensor([1.0, 0.0]), torch.tensor([0, 1]), mask, kl=kl, kl_reward_coef=0.5, gamma=1.0
    )
    # token rewards: row0 [-0.5, 1] -> returns [0.5, 1]; row1 [0, 0] -> [0, 0]
    g = torch.tensor([0.5, 1.0, 0.0, 0.0])
    expected = ((g - g.mean()) / torch.sqrt(g.var(unbiased=False) + 1e-8)).view(2, 2)
    assert torch.allclose(adv, expected, atol=1e-6)
    assert float((adv * mask).sum()) == pytest.approx(0.0, abs=1e-6)


def test_reinforce_pp_baseline_subtracts_group_mean_first():
    mask = torch.ones(4, 1)
    rewards = torch.tensor([1.0, 0.0, 3.0, 3.0])
    groups = torch.tensor([0, 0, 1, 1])
    adv = ADVANTAGE_ESTIMATORS.get("reinforce_pp_baseline")(rewards, groups, mask)
    g = torch.tensor([0.5, -0.5, 0.0, 0.0])  # centred per group; the all-equal group is 0 before whitening
    expected = (g - g.mean()) / torch.sqrt(g.var(unbiased=False) + 1e-8)
    assert torch.allclose(adv[:, 0], expected, atol=1e-6)
    assert adv[2, 0] == adv[3, 0]


def test_gae_hand_computed():
    rewards = t([0.0, 0.0, 1.0])
    values = t([0.5, 0.2, 0.4])
    mask = t([1, 1, 1])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    d2 = 1.0 - 0.4  # last token: V_next = 0
    d1 = 0.0 + 0.9 * 0.4 - 0.2
    d0 = 0.0 + 0.9 * 0.2 - 0.5
    a2 = d2
    a1 = d1 + 0.45 * a2
    a0 = d0 + 0.45 * a1
    assert torch.allclose(adv, t([a0, a1, a2]), atol=1e-6)
    assert torch.allclose(ret, t([a0 + 0.5, a1 + 0.2, a2 + 0.4]), atol=1e-6)


def test_gae_lambda_one_gamma_one_is_return_minus_value_and_masked_row():
    mask = t([1, 1, 0], [0, 0, 0])
    values = t([0.3, 0.1, 9.0], [1.0, 1.0, 1.0])
    rewards = last_token_rewards(torch.tensor([1.0, 1.0]), mask)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert torch.allclose(adv, t([0.7, 0.9, 0.0], [0, 0, 0]), atol=1e-6)
    assert torch.allclose(ret, t([1.0, 1.0, 0.0], [0, 0, 0]), atol=1e-6)


def test_gae_estimator_requires_values_and_whitens():
    with pytest.raises(ValueError, match="critic"):
        ADVANTAGE_ESTIMATORS.get("gae")(torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1, 2))
    adv = ADVANTAGE_ESTIMATORS.get("gae")(
        torch.tensor([1.0, 0.0]), torch.tensor([0, 1]), torch.ones(2, 2), values=torch.zeros(2, 2)
    )
    assert float(adv.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(adv.var(unbiased=False)) == pytest.approx(1.0, abs=1e-4)


def test_distillation_advantage():
    adv = distillation_advantages(t([1.0, 1.0]), t([-1.0, -2.0]), t([-0.5, -3.0]), t([1, 0]), coef=2.0)
    # 1 - 2*(-1 + 0.5) = 2 ; masked token -> 0
    assert torch.allclose(adv, t([2.0, 0.0]))


# ---------------------------------------------------------------- policy losses
def test_ppo_clip_ratio_far_outside_range_and_clip_higher():
    c = cfg(clip_low=0.2, clip_high=0.28, clip_c=None)
    old = torch.zeros(1, 3)
    logp = torch.log(t([3.0, 0.1, 1.1]))  # ratios 3 (far above), 0.1 (far below), 1.1 (inside)
    adv = t([1.0, 1.0, -1.0])
    loss, m = POLICY_LOSSES.get("ppo_clip")(logp, old, adv, torch.ones(1, 3), c)
    # A>0, r=3: max(-3, -1.28) = -1.28 (clipped); A>0, r=0.1: max(-0.1, -0.8) = -0.1; A<0, r=1.1: 1.1
    assert torch.allclose(loss, t([-1.28, -0.1, 1.1]), atol=1e-5)
    assert float(m["clip_frac"]) == pytest.approx(1 / 3)
    assert float(m["ratio_max"]) == pytest.approx(3.0, rel=1e-5)
    assert float(m["ratio_min"]) == pytest.approx(0.1, rel=1e-5)


def test_ppo_dual_clip_active_for_negative_advantage():
    c = cfg(clip_low=0.2, clip_high=0.2, clip_c=3.0)
    logp = torch.log(t([10.0, 10.0]))
    loss, m = POLICY_LOSSES.get("ppo_clip")(logp, torch.zeros(1, 2), t([-1.0, 1.0]), torch.ones(1, 2), c)
    # A=-1, r=10: max(10, 1.2) = 10 -> dual clip min(10, 3) = 3; A=+1: clipped to -1.2
    assert torch.allclose(loss, t([3.0, -1.2]), atol=1e-5)
    assert float(m["dual_clip_frac"]) == pytest.approx(0.5)


def test_ppo_gradient_zero_when_clipped():
    c = cfg(clip_low=0.2, clip_high=0.2, clip_c=None)
    logp = torch.log(t([2.0])).requires_grad_()
    loss, _ = POLICY_LOSSES.get("ppo_clip")(logp, torch.zeros(1, 1), t([1.0]), torch.ones(1, 1), c)
    loss.sum().backward()
    assert float(logp.grad) == 0.0


def test_gspo_sequence_ratio_and_clip():
    c = cfg(clip_low=0.1, clip_high=0.1, clip_c=None)
    mask = t([1, 1, 0])
    old = torch.zeros(1, 3)
    logp = t([0.2, 0.0, 5.0]).requires_grad_()  # masked third token must not count
    loss, m = POLICY_LOSSES.get("gspo")(logp, old, t([1.0, 1.0, 1.0]), mask, c)
    s = math.exp(0.1)  # exp(mean(0.2, 0.0)) = 1.105 > 1.1 -> clipped for A>0
    assert torch.allclose(loss[0, :2], torch.tensor([-1.1, -1.1]), atol=1e-5)
    assert float(m["clip_frac"]) == pytest.approx(1.0)
    # inside the range the value equals s and the gradient of token t is -A·s (per-token form)
    c2 = cfg(clip_low=0.5, clip_high=0.5, clip_c=None)
    logp2 = t([0.2, 0.0, 5.0]).requires_grad_()
    loss2, _ = POLICY_LOSSES.get("gspo")(logp2, old, t([1.0, 1.0, 1.0]), mask, c2)
    assert torch.allclose(loss2[0, :2], torch.tensor([-s, -s]), atol=1e-5)
    (loss2 * mask).sum().backward()
    assert torch.allclose(logp2.grad[0, :2], torch.tensor([-s, -s]), atol=1e-5)


def test_sapo_soft_gate_values_and_zero_advantage():
    c = cfg(tau_pos=1.0, tau_neg=2.0)
    old = torch.zeros(1, 3)
    logp = torch.log(t([1.0, 1.5, 1.0])).requires_grad_()
    adv = t([1.0, -1.0, 0.0])
    loss, _ = POLICY_LOSSES.get("sapo")(logp, old, adv, torch.ones(1, 3), c)
    # r=1, A>0, tau=1: f = 4*sigmoid(0) = 2 -> loss -2
    # r=1.5, A<0, tau=2: f = 2*sigmoid(1) -> loss +2*sigmoid(1)
    # A=0 (tau_neg branch): loss 0
    assert torch.allclose(loss, t([-2.0, 2 * torch.sigmoid(torch.tensor(1.0)).item(), 0.0]), atol=1e-6)
    loss.sum().backward()
    # at r=1 the gate gradient equals the on-policy one: d(-f·A)/dlogp = -A
    assert float(logp.grad[0, 0]) == pytest.approx(-1.0, abs=1e-6)
    assert float(logp.grad[0, 2]) == 0.0


def test_sapo_gate_decays_far_from_one():
    c = cfg(tau_pos=1.0, tau_neg=1.0)
    logp = torch.log(t([20.0])).requires_grad_()
    loss, m = POLICY_LOSSES.get("sapo")(logp, torch.zeros(1, 1), t([1.0]), torch.ones(1, 1), c)
    loss.sum().backward()
    sig = torch.sigmoid(torch.tensor(19.0))
    assert float(logp.grad) == pytest.approx(-(4 * sig * (1 - sig) * 20).item(), rel=1e-4)
    assert abs(float(logp.grad)) < 1e-5
    assert float(m["clip_frac"]) == 1.0


def test_cispo_stopgrad_clipped_weight():
    c = cfg(clip_low=1.0, clip_high=0.2)
    old = torch.zeros(1, 3)
    logp = torch.log(t([3.0, 0.5, 1.0])).requires_grad_()
    adv = t([2.0, -1.0, 1.0])
    loss, m = POLICY_LOSSES.get("cispo")(logp, old, adv, torch.ones(1, 3), c)
    w = torch.tensor([1.2, 0.5, 1.0])  # 3 clipped to 1.2; 0.5 kept (lower bound 0)
    assert torch.allclose(loss[0], -w * adv[0] * logp.detach()[0], atol=1e-6)
    loss.sum().backward()
    # the gradient is -w·A for every token, even the clipped one (CISPO keeps all gradients)
    assert torch.allclose(logp.grad[0], -w * adv[0], atol=1e-6)
    assert float(m["clip_frac"]) == pytest.approx(1 / 3)


def test_log_ratio_clamp_prevents_overflow():
    c = cfg(clip_c=None, log_ratio_clamp=5.0)
    loss, m = POLICY_LOSSES.get("ppo_clip")(t([200.0]), t([0.0]), t([-1.0]), t([1.0]), c)
    assert torch.isfinite(loss).all()
    assert float(m["ratio_max"]) == pytest.approx(math.exp(5.0), rel=1e-5)


def test_fully_masked_sequence_contributes_nothing():
    c = cfg()
    mask = t([1, 1], [0, 0])
    for name in POLICY_LOSSES.names():
        logp = t([-1.0, -2.0], [-0.5, -0.1]).requires_grad_()
        loss, m = POLICY_LOSSES.get(name)(logp, logp.detach() + 0.1, t([1.0, 1.0], [3.0, 3.0]), mask, c)
        total = LOSS_AGGREGATIONS.get("seq-mean-token-mean")(loss, mask)
        total.backward()
        assert torch.equal(logp.grad[1], torch.zeros(2)), name
        assert all(torch.isfinite(torch.as_tensor(v)).all() for v in m.values()), name


# ---------------------------------------------------------------- aggregations, KL, TIS, shaping, value
def test_aggregations_hand_computed():
    loss = t([1.0, 2.0, 3.0], [4.0, 0.0, 0.0])
    mask = t([1, 1, 1], [1, 0, 0])
    assert float(LOSS_AGGREGATIONS.get("token-mean")(loss, mask)) == pytest.approx(10 / 4)
    assert float(LOSS_AGGREGATIONS.get("seq-mean-token-mean")(loss, mask)) == pytest.approx((2 + 4) / 2)
    assert float(LOSS_AGGREGATIONS.get("seq-mean-token-sum")(loss, mask)) == pytest.approx((6 + 4) / 2)
    assert float(LOSS_AGGREGATIONS.get("seq-mean-token-sum-norm")(loss, mask, 5.0)) == pytest.approx(10 / 10)
    with pytest.raises(ValueError, match="positive scale"):
        LOSS_AGGREGATIONS.get("seq-mean-token-sum-norm")(loss, mask, 0.0)


@pytest.mark.parametrize("micro_batch_size", [1, 2, 4])
def test_dr_grpo_loss_does_not_depend_on_the_micro_batch_split(micro_batch_size):
    """Dr. GRPO without algorithm.loss_scale divides by C = rollout.max_new_tokens = 10, whatever width each
    micro-batch is trimmed to. On-policy (ratio 1) the token loss is −A: rows of 3, 1, 2 and 1 tokens with
    A = 1, −1, 0.5, 2 give Σ m·A = 3 − 1 + 1 + 2 = 5, so loss = −5 / (B·C) = −5/40 and ∂loss/∂log π = −A/40."""
    from relax_core.roles.actor import effective_algorithm
    from tests.core.conftest import typed_config

    algo = effective_algorithm(
        typed_config("algorithm=dr_grpo", "algorithm.loss_scale=null", "rollout.max_new_tokens=10")
    )
    lens, adv = [3, 1, 2, 1], [1.0, -1.0, 0.5, 2.0]
    samples = [Sample(i, 0, [5], [7] * n, [-1.0] * n, [1] * n) for i, n in enumerate(lens)]
    batch = TrainBatch.from_samples(samples, pad_token_id=0)
    batch.extras["advantages"] = torch.tensor(adv).unsqueeze(-1) * batch.loss_mask
    logprobs = torch.full(batch.loss_mask.shape, -1.0, requires_grad=True)
    total, rows = 0.0, list(range(len(lens)))
    for start in range(0, len(lens), micro_batch_size):
        part = rows[start : start + micro_batch_size]
        micro = batch.select(part)  # trimmed to its own longest response
        lp = logprobs[part, : micro.loss_mask.shape[1]]
        weight = micro_batch_weight(micro, float(batch.loss_mask.sum()), len(batch), algo)
        loss, _ = policy_objective(micro, lp, torch.zeros_like(lp), algo, weight)
        total = total + loss
    total.backward()
    assert float(total.detach()) == pytest.approx(-5 / 40)
    assert torch.allclose(logprobs.grad, -batch.extras["advantages"] / 40)


def test_truncated_is_weights():
    w = truncated_is_weights(t([0.0, 0.0, -1.0]), t([-2.0, 0.0, 0.0]), cap=2.0)
    assert torch.allclose(w, t([2.0, 1.0, math.exp(-1.0)]))


def _batch(rewards, responses, rollout_lp):
    samples = [
        Sample(i // 2, i % 2, [5, 6], resp, lp, [1] * len(resp), reward=r)
        for i, (r, resp, lp) in enumerate(zip(rewards, responses, rollout_lp, strict=True))
    ]
    return TrainBatch.from_samples(samples, pad_token_id=0)


def test_policy_objective_applies_tis_and_reports_metrics():
    batch = _batch([1.0, 0.0], [[1, 2], [3]], [[-1.0, -1.0], [-1.0]])
    logp = t([-1.0, -1.0], [-1.0, 0.0])
    batch.extras["advantages"] = t([1.0, 1.0], [1.0, 0.0])
    entropy = torch.zeros(2, 2)
    base = cfg(tis_cap=None, entropy_coef=0.0)
    loss_plain, m_plain = policy_objective(batch, logp, entropy, base)
    # on-policy: ratio 1 -> per-token loss -A; token mean over 3 tokens = -1
    assert float(loss_plain) == pytest.approx(-1.0)
    batch.extras["old_logprobs"] = t([0.0, -1.0], [-1.0, 0.0])  # first token: w = e^1 capped at 2
    loss_tis, m = policy_objective(batch, logp, entropy, cfg(tis_cap=2.0, entropy_coef=0.0, clip_c=None))
    # token 0: ratio e^-1 (A>0 -> -e^-1 unclipped? clip lower 0.8 -> max(-0.368, -0.8) = -0.368) * 2
    r0 = math.exp(-1.0)
    assert float(loss_tis) == pytest.approx((-r0 * 2.0 - 1.0 - 1.0) / 3, rel=1e-5)
    assert m["tis/weight_mean"] == pytest.approx((2.0 + 1 + 1) / 3, rel=1e-5)
    for key in ("clip_frac", "approx_kl", "ratio_mean", "ratio_max", "entropy", "pg_loss"):
        assert key in m


def test_overlong_penalty():
    lens = torch.tensor([3, 6, 7, 8, 9])
    p = overlong_penalty(lens, max_len=8, buffer=2, factor=1.0)
    assert torch.allclose(p, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))
    assert torch.equal(overlong_penalty(lens, 8, 0), torch.zeros(5))


def test_groups_with_spread():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.5, 0.2])
    groups = torch.tensor([0, 0, 1, 1, 2])
    assert groups_with_spread(rewards, groups).tolist() == [False, False, True, True, False]


def test_clipped_value_loss():
    values = t([1.0, 0.0]).requires_grad_()
    old = t([0.0, 0.0])
    ret = t([2.0, 1.0])
    loss, m = clipped_value_loss(values, old, ret, t([1, 1]), clip=0.2)
    # token 0: unclipped (1-2)^2 = 1, clipped (0.2-2)^2 = 3.24 -> 3.24; token 1: 1 vs 1 -> 1
    assert float(loss.detach()) == pytest.approx(0.5 * (3.24 + 1.0) / 2)
    assert float(m["critic/vf_clip_frac"]) == pytest.approx(0.5)
    loss.backward()
    assert float(values.grad[0, 0]) == 0.0  # clipped branch is constant in V
    plain, _ = clipped_value_loss(t([1.0]), t([0.0]), t([2.0]), t([1]), clip=None)
    assert float(plain) == pytest.approx(0.5)


def test_every_shipped_config_names_registered_functions():
    from pathlib import Path

    import yaml

    conf = Path(__file__).resolve().parents[2] / "conf" / "algorithm"
    names = sorted(p.stem for p in conf.glob("*.yaml"))
    assert set(names) >= {
        "grpo", "dr_grpo", "dapo", "gspo", "sapo", "cispo", "rloo",
        "reinforce_pp", "reinforce_pp_baseline", "ppo", "opd",
    }  # fmt: skip
    for name in names:
        spec = yaml.safe_load((conf / f"{name}.yaml").read_text())
        assert spec["name"] == name
        ADVANTAGE_ESTIMATORS.get(spec["advantage_estimator"])
        POLICY_LOSSES.get(spec["policy_loss"])
        LOSS_AGGREGATIONS.get(spec["loss_agg_mode"])


def test_namespace_cfg_is_enough_for_losses():
    ns = SimpleNamespace(clip_low=0.2, clip_high=0.2, clip_c=None, tau_pos=1.0, tau_neg=1.0)
    for name in POLICY_LOSSES.names():
        loss, _ = POLICY_LOSSES.get(name)(t([0.0]), t([0.0]), t([1.0]), t([1.0]), ns)
        assert torch.isfinite(loss).all()
