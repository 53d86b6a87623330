"""Advantage estimators: rewards (one per sample) -> per-token advantages ``[B, R]``."""

from __future__ import annotations

import torch

from relax_core.algorithms.masked import masked_whiten
from relax_core.algorithms.registry import ADVANTAGE_ESTIMATORS


def group_stats(
    values: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample mean, unbiased std and size of the sample's group (groups by id, not position), float64.

    A group of one has std 0. A group whose values are all equal has exactly their value as its mean (and
    std 0): a summed mean can be an ulp off, and (r − mean)/(std + eps) would blow that ulp up.
    """
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    v = values.to(torch.float64)
    empty = torch.zeros(len(counts), dtype=torch.float64, device=v.device)
    lo = empty.scatter_reduce(0, inverse, v, "amin", include_self=False)
    hi = empty.scatter_reduce(0, inverse, v, "amax", include_self=False)
    counts_f = counts.to(torch.float64)
    means = torch.where(lo == hi, lo, empty.index_add(0, inverse, v) / counts_f)
    sq = empty.index_add(0, inverse, (v - means[inverse]) ** 2)
    std = torch.where(counts > 1, (sq / (counts_f - 1).clamp_min(1.0)).sqrt(), empty)
    return means[inverse], std[inverse], counts[inverse]


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-normalised outcome advantage, broadcast over the response tokens.

    A_i = (r_i − mean_g(r)) / (std_g(r) + eps)   with the unbiased std of sample i's group g;
    A_i = r_i − mean_g(r)                        when ``norm_by_std`` is false (Dr. GRPO).
    All-equal rewards in a group give A = 0 for its samples, in any dtype (statistics in float64).
    """
    mean, std, _ = group_stats(rewards, group_ids)
    adv = rewards - mean
    if norm_by_std:
        adv = adv / (std + eps)
    return adv.to(rewards.dtype).unsqueeze(-1) * loss_mask


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out: the baseline of sample i is the mean reward of the *other* samples.

    A_i = r_i − (Σ_{j∈g} r_j − r_i)/(n_g − 1) = n_g/(n_g − 1) · (r_i − mean_g(r));
    a group of one has no other sample and gets A = 0, and so does a group of all-equal rewards.
    """
    mean, _, counts = group_stats(rewards, group_ids)
    n = counts.to(mean.dtype)
    adv = torch.where(counts > 1, n / (n - 1).clamp_min(1.0) * (rewards - mean), torch.zeros_like(mean))
    return adv.to(rewards.dtype).unsqueeze(-1) * loss_mask


@ADVANTAGE_ESTIMATORS.register("reinforce")
def reinforce_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """Plain REINFORCE, no baseline: A_i = r_i on every response token.

    The reference point the baselines of GRPO and RLOO improve on: same expected gradient, more variance.
    """
    return rewards.unsqueeze(-1) * loss_mask


def last_token_rewards(rewards: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Token rewards ``[B, R]`` holding the outcome reward r_i on the last trained token of row i, 0 elsewhere.

    A fully masked row carries no reward.
    """
    positions = torch.arange(loss_mask.shape[1], device=loss_mask.device).expand_as(loss_mask)
    last = torch.where(loss_mask > 0, positions, torch.full_like(positions, -1)).max(-1).values
    out = torch.zeros_like(loss_mask, dtype=rewards.dtype)
    has = last >= 0
    out[has, last[has]] = rewards[has]
    return out


def discounted_returns(token_rewards: torch.Tensor, loss_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = Σ_{k≥t, m_k=1} γ^(#trained tokens between t and k) · r_k, right to left; 0 at masked tokens."""
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        m = loss_mask[:, t]
        running = torch.where(m > 0, token_rewards[:, t] + gamma * running, running)
        returns[:, t] = running * m
    return returns


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def reinforce_pp_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_reward_coef: float = 0.0,
    gamma: float = 1.0,
) -> torch.Tensor:
    """REINFORCE++: discounted token returns with a per-token KL penalty, whitened over the batch.

    r_t = −β·kl_t + [t = last]·r_i;   G_t = r_t + γ·G_{t+1};   A = (G − mean_B(G)) / sqrt(var_B(G) + 1e-8)
    with mean/var over every trained token of the batch (``kl`` is e.g. k1(log π_old, log π_ref)).
    """
    token_rewards = last_token_rewards(rewards, loss_mask)
    if kl is not None and kl_reward_coef:
        token_rewards = token_rewards - kl_reward_coef * kl * loss_mask
    returns = discounted_returns(token_rewards, loss_mask, gamma)
    return masked_whiten(returns, loss_mask) * loss_mask


@ADVANTAGE_ESTIMATORS.register("reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_reward_coef: float = 0.0,
    gamma: float = 1.0,
) -> torch.Tensor:
    """REINFORCE++ with a group baseline: r_i ← r_i − mean_g(r) first, then :func:`reinforce_pp_advantages`.

    Subtracting the group mean removes the prompt's difficulty from the return before batch whitening; an
    all-equal group is centred to exactly 0.
    """
    mean, _, _ = group_stats(rewards, group_ids)
    centred = (rewards - mean).to(rewards.dtype)
    return reinforce_pp_advantages(centred, group_ids, loss_mask, kl, kl_reward_coef, gamma)


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the trained tokens; returns (advantages, returns).

    δ_t = r_t + γ·V_{t+1} − V_t (V after the last token is 0);   A_t = δ_t + γλ·A_{t+1};   R_t = A_t + V_t.
    Masked tokens are skipped: they neither carry a value nor break the recursion.
    """
    adv = torch.zeros_like(token_rewards)
    next_value = torch.zeros_like(token_rewards[:, 0])
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        m = loss_mask[:, t] > 0
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        new_running = delta + gamma * lam * running
        running = torch.where(m, new_running, running)
        next_value = torch.where(m, values[:, t], next_value)
        adv[:, t] = running * loss_mask[:, t]
    returns = (adv + values) * loss_mask
    return adv, returns


@ADVANTAGE_ESTIMATORS.register("gae")
def gae_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> torch.Tensor:
    """PPO advantages: :func:`gae` on the outcome reward at the last token, whitened over the batch.

    Needs the Critic's ``values`` ``[B, R]`` (V_t = value of the state before response token t).
    """
    if values is None:
        raise ValueError("the gae estimator needs critic values (algorithm.critic must be configured)")
    adv, _ = gae(last_token_rewards(rewards, loss_mask), values, loss_mask, gamma, lam)
    return masked_whiten(adv, loss_mask) * loss_mask


def distillation_advantages(
    advantages: torch.Tensor,
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    coef: float,
) -> torch.Tensor:
    """On-policy distillation: A_t ← A_t − c·(log π_student(y_t) − log π_teacher(y_t)).

    The per-token reverse-KL estimate log π_s − log π_t is negative where the teacher likes the sampled
    token more than the student does, which raises that token's advantage.
    """
    return (advantages - coef * (student_logprobs - teacher_logprobs)) * loss_mask
