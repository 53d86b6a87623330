"""Sampling rules some algorithms add around the rollout, shared by both modes: DAPO's soft overlong
penalty and dynamic sampling (drop zero-spread groups, sample more prompts until ``rollout.batch_size``
groups with signal are found or ``max_gen_batches`` is hit), and PPO's critic warm-up (the actor waits
during ``critic.warmup_steps``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from relax_core.algorithms.shaping import groups_with_spread, overlong_penalty
from relax_core.samples import Sample

if TYPE_CHECKING:
    from relax_core.config.schema import AlgorithmConfig

log = logging.getLogger("relax")


# what a step logs for the actor while the critic warms up (the step line and sinks expect these keys)
FROZEN_ACTOR_METRICS = {"loss": 0.0, "entropy": float("nan"), "actor_frozen": 1.0}


def critic_warming_up(algorithm_cfg: AlgorithmConfig, step: int) -> bool:
    """True for RL steps 1..``critic.warmup_steps``: the actor does not move until the values mean something."""
    return algorithm_cfg.critic is not None and step <= algorithm_cfg.critic.warmup_steps


def shape_rewards(samples: list[Sample], algorithm_cfg: AlgorithmConfig, max_new_tokens: int) -> list[Sample]:
    """DAPO's soft overlong penalty added to each sample's reward (in place; a no-op when the buffer is 0)."""
    a = algorithm_cfg
    if a.overlong_buffer > 0 and samples:
        lens = torch.tensor([len(s.response_ids) for s in samples])
        penalty = overlong_penalty(lens, max_new_tokens, a.overlong_buffer, a.overlong_penalty_factor)
        for sample, p in zip(samples, penalty.tolist(), strict=True):
            sample.reward += p
            sample.reward_extras["overlong_penalty"] = p
    return samples


def with_spread(samples: list[Sample]) -> list[Sample]:
    """The samples whose prompt group's rewards are not all equal (dynamic sampling keeps only these)."""
    if not samples:
        return []
    keep = groups_with_spread(
        torch.tensor([s.reward for s in samples]), torch.tensor([s.group_id for s in samples])
    )
    return [s for s, k in zip(samples, keep.tolist(), strict=True) if k]


def dynamic_sampling_metrics(
    rounds: int, kept_groups: int, generated_groups: int, generated_rewards: list[float]
) -> dict[str, float]:
    return {
        "dynamic_sampling/gen_batches": float(rounds),
        "dynamic_sampling/kept_group_frac": kept_groups / max(generated_groups, 1),
        "dynamic_sampling/reward_all_mean": sum(generated_rewards) / max(len(generated_rewards), 1),
    }


def collect_with_dynamic_sampling(
    sample_round: Callable[[], list[Sample]],
    algorithm_cfg: AlgorithmConfig,
    batch_size: int,
    max_new_tokens: int,
) -> tuple[list[Sample], dict[str, float]]:
    """One step's samples: ``sample_round()`` samples ``batch_size`` prompts, shaped by :func:`shape_rewards`.

    With DAPO's dynamic sampling, zero-spread groups are dropped and more rounds run until ``batch_size``
    groups with signal are found or ``max_gen_batches`` rounds ran; returns the samples and its metrics.
    """
    a = algorithm_cfg
    samples = shape_rewards(sample_round(), a, max_new_tokens)
    if not a.dynamic_sampling:
        return samples, {}
    generated, kept, rounds = list(samples), with_spread(samples), 1
    while _num_groups(kept) < batch_size and rounds < a.max_gen_batches:
        more = shape_rewards(sample_round(), a, max_new_tokens)
        generated += more
        kept += with_spread(more)
        rounds += 1
    metrics = dynamic_sampling_metrics(
        rounds, _num_groups(kept), _num_groups(generated), [s.reward for s in generated]
    )
    if not kept:  # nothing with signal: train on the last round (zero advantages, no policy change)
        return samples, metrics
    wanted = set(list(dict.fromkeys(s.group_id for s in kept))[:batch_size])
    return [s for s in kept if s.group_id in wanted], metrics


def _num_groups(samples: list[Sample]) -> int:
    return len({s.group_id for s in samples})
