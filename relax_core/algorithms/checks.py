"""Algorithm settings that cannot work together; checked by ``relax_core.preflight.validation`` before Ray starts.

The rules of the configured estimator, loss, aggregation and algorithm come from
:mod:`relax_core.algorithms.spec`; :data:`SHARED_RULES` hold for every algorithm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax_core.algorithms.spec import Constraint, constraints

if TYPE_CHECKING:
    from relax_core.config.schema import RelaxConfig


def _critic_ok(c) -> bool:
    return c is None or (c.lr > 0 and c.epochs >= 1 and c.micro_batch_size >= 1 and c.warmup_steps >= 0)


SHARED_RULES: tuple[Constraint, ...] = (
    Constraint(
        lambda a, r: _critic_ok(a.critic),
        "algorithm.critic needs lr > 0, epochs >= 1, micro_batch_size >= 1 and warmup_steps >= 0",
    ),
    Constraint(
        lambda a, r: a.critic is None or a.critic.value_clip is None or a.critic.value_clip > 0,
        "algorithm.critic.value_clip must be > 0 or null, got {a.critic.value_clip}",
    ),
    Constraint(lambda a, r: 0.0 <= a.gamma <= 1.0, "algorithm.gamma must be in [0, 1], got {a.gamma}"),
    Constraint(lambda a, r: 0.0 <= a.lam <= 1.0, "algorithm.lam must be in [0, 1], got {a.lam}"),
    Constraint(
        lambda a, r: a.clip_low >= 0 and a.clip_high >= 0,
        "algorithm.clip_low/clip_high must be >= 0, got {a.clip_low}, {a.clip_high}",
    ),
    Constraint(
        lambda a, r: a.clip_c is None or a.clip_c > 1.0,
        "algorithm.clip_c (dual clip) must be > 1 or null, got {a.clip_c}",
    ),
    Constraint(
        lambda a, r: a.tis_cap is None or a.tis_cap > 0,
        "algorithm.tis_cap (truncated importance sampling) must be > 0 or null, got {a.tis_cap}",
    ),
    Constraint(
        lambda a, r: a.log_ratio_clamp > 0, "algorithm.log_ratio_clamp must be > 0, got {a.log_ratio_clamp}"
    ),
    Constraint(
        lambda a, r: a.kl_reward_coef >= 0 and a.kl_loss_coef >= 0,
        "algorithm.kl_loss_coef and algorithm.kl_reward_coef must be >= 0",
    ),
    Constraint(
        lambda a, r: not a.dynamic_sampling or a.max_gen_batches >= 1,
        "algorithm.max_gen_batches must be >= 1, got {a.max_gen_batches}",
    ),
    Constraint(
        lambda a, r: 0 <= a.overlong_buffer < r.max_new_tokens,
        "algorithm.overlong_buffer must be in [0, rollout.max_new_tokens={r.max_new_tokens}), got {a.overlong_buffer}",
    ),
    Constraint(
        lambda a, r: a.teacher is None or a.teacher.coef > 0,
        "algorithm.teacher.coef must be > 0, got {a.teacher.coef}",
    ),
)


def validate_algorithm(cfg: RelaxConfig) -> None:
    """Raise :class:`RelaxUserError` naming the first algorithm key whose value cannot work."""
    for rule in (*constraints(cfg.algorithm), *SHARED_RULES):
        rule.check(cfg)
