"""Config rules of agentic runs (called from :func:`relax_core.validation.validate` when rollout.env is set)."""

from __future__ import annotations

from relax_core.agentic.env import resolve_env_class
from relax_core.errors import RelaxUserError

FAILED_SAMPLE_POLICIES = ["mask", "keep"]


def validate_agentic(cfg) -> None:
    r = cfg.rollout
    if not isinstance(r.env, dict):
        raise RelaxUserError("rollout.env must be a mapping with _target_ (or null for single-turn)")
    resolve_env_class(dict(r.env))
    if r.failed_sample_policy not in FAILED_SAMPLE_POLICIES:
        raise RelaxUserError(
            f"rollout.failed_sample_policy={r.failed_sample_policy!r} is not one of {FAILED_SAMPLE_POLICIES}"
        )
    if r.max_turns < 1:
        raise RelaxUserError(f"rollout.max_turns must be >= 1, got {r.max_turns}")
    if r.env_step_timeout_s <= 0:
        raise RelaxUserError(f"rollout.env_step_timeout_s must be > 0, got {r.env_step_timeout_s}")
    if r.max_context_len <= r.max_new_tokens:
        raise RelaxUserError(
            f"rollout.max_context_len={r.max_context_len} leaves no room for a prompt and "
            f"rollout.max_new_tokens={r.max_new_tokens}"
        )
    if cfg.model.tiny is not None and r.max_context_len > cfg.model.tiny.max_position_embeddings:
        raise RelaxUserError(
            f"rollout.max_context_len={r.max_context_len} exceeds the model's "
            f"max_position_embeddings={cfg.model.tiny.max_position_embeddings}"
        )
