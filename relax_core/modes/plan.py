"""Which roles and per-token fields a run needs (interim home; replaced by the algorithm spec)."""

from __future__ import annotations

from dataclasses import dataclass

# estimators whose advantage of a sample depends only on its own prompt group
GROUP_LOCAL_ESTIMATORS = {"grpo", "rloo"}


@dataclass(frozen=True)
class Requirements:
    reference: bool
    critic: bool
    teacher: bool
    actor_fwd: bool
    advantage_inputs: tuple[str, ...]
    group_local: bool


def requirements(cfg) -> Requirements:
    a, r, t = cfg.algorithm, cfg.rollout, cfg.trainer
    step_samples = r.batch_size * r.n_samples_per_prompt
    # several optimizer steps per rollout batch: the behaviour policy's log-probs need their own forward
    actor_fwd = a.ppo_epochs > 1 or (t.global_batch_size or step_samples) < step_samples
    inputs = ["values"] if a.critic is not None else []
    inputs += ["teacher_logprobs"] if a.teacher is not None else []
    inputs += ["ref_logprobs"] if a.kl_reward_coef > 0 else []
    if actor_fwd and (a.teacher is not None or a.kl_reward_coef > 0):
        inputs.append("old_logprobs")
    return Requirements(
        reference=a.kl_loss_coef > 0 or a.kl_reward_coef > 0,
        critic=a.critic is not None,
        teacher=a.teacher is not None,
        actor_fwd=actor_fwd,
        advantage_inputs=tuple(inputs),
        group_local=a.advantage_estimator in GROUP_LOCAL_ESTIMATORS,
    )
