"""Algorithm settings that cannot work together; checked by ``relax_core.validation`` before Ray starts."""

from __future__ import annotations

from relax_core.errors import RelaxUserError

# estimators whose baseline is the other samples of the same prompt
GROUP_ESTIMATORS = {"rloo": "a leave-one-out baseline", "reinforce_pp_baseline": "a group-mean baseline"}


def validate_algorithm(cfg) -> None:
    """Raise :class:`RelaxUserError` naming the first algorithm key whose value cannot work."""
    a, r = cfg.algorithm, cfg.rollout
    name = a.name
    n = r.n_samples_per_prompt
    if a.advantage_estimator in GROUP_ESTIMATORS and n < 2:
        raise RelaxUserError(
            f"algorithm {name} ({a.advantage_estimator}) needs rollout.n_samples_per_prompt >= 2 for "
            f"{GROUP_ESTIMATORS[a.advantage_estimator]}, got {n}"
        )
    if a.loss_agg_mode == "seq-mean-token-sum-norm" and a.loss_scale is not None and a.loss_scale <= 0:
        raise RelaxUserError(
            f"algorithm.loss_scale must be > 0 for seq-mean-token-sum-norm (Dr. GRPO's constant), got {a.loss_scale}"
        )
    if a.advantage_estimator == "gae" and a.critic is None:
        raise RelaxUserError(
            "advantage_estimator=gae needs a value model: set algorithm.critic (e.g. algorithm=ppo)"
        )
    if a.critic is not None:
        c = a.critic
        if c.lr <= 0 or c.epochs < 1 or c.micro_batch_size < 1 or c.warmup_steps < 0:
            raise RelaxUserError(
                "algorithm.critic needs lr > 0, epochs >= 1, micro_batch_size >= 1 and warmup_steps >= 0"
            )
        if c.value_clip is not None and c.value_clip <= 0:
            raise RelaxUserError(f"algorithm.critic.value_clip must be > 0 or null, got {c.value_clip}")
    for key in ("gamma", "lam"):
        value = getattr(a, key)
        if not 0.0 <= value <= 1.0:
            raise RelaxUserError(f"algorithm.{key} must be in [0, 1], got {value}")
    if a.policy_loss == "sapo" and (a.tau_pos <= 0 or a.tau_neg <= 0):
        raise RelaxUserError(
            f"algorithm.tau_pos and algorithm.tau_neg (SAPO gate temperatures) must be > 0, got {a.tau_pos}, {a.tau_neg}"
        )
    if a.clip_low < 0 or a.clip_high < 0:
        raise RelaxUserError(f"algorithm.clip_low/clip_high must be >= 0, got {a.clip_low}, {a.clip_high}")
    if a.tis_cap is not None and a.tis_cap <= 0:
        raise RelaxUserError(
            f"algorithm.tis_cap (truncated importance sampling) must be > 0 or null, got {a.tis_cap}"
        )
    if a.log_ratio_clamp <= 0:
        raise RelaxUserError(f"algorithm.log_ratio_clamp must be > 0, got {a.log_ratio_clamp}")
    if a.kl_reward_coef < 0 or a.kl_loss_coef < 0:
        raise RelaxUserError("algorithm.kl_loss_coef and algorithm.kl_reward_coef must be >= 0")
    if a.kl_reward_coef > 0 and not a.advantage_estimator.startswith("reinforce_pp"):
        raise RelaxUserError(
            f"algorithm.kl_reward_coef (reward-side KL) is used by the reinforce_pp estimators, not {a.advantage_estimator!r}"
        )
    if a.dynamic_sampling:
        if n < 2:
            raise RelaxUserError(
                "algorithm.dynamic_sampling needs rollout.n_samples_per_prompt >= 2 (reward spread)"
            )
        if a.max_gen_batches < 1:
            raise RelaxUserError(f"algorithm.max_gen_batches must be >= 1, got {a.max_gen_batches}")
    if a.overlong_buffer < 0 or a.overlong_buffer >= r.max_new_tokens:
        raise RelaxUserError(
            f"algorithm.overlong_buffer must be in [0, rollout.max_new_tokens={r.max_new_tokens}), got {a.overlong_buffer}"
        )
    if a.teacher is not None and a.teacher.coef <= 0:
        raise RelaxUserError(f"algorithm.teacher.coef must be > 0, got {a.teacher.coef}")
    if a.teacher is not None and a.teacher.teacher_only and a.teacher.coef <= 0:
        raise RelaxUserError("algorithm.teacher.teacher_only needs algorithm.teacher.coef > 0")
