"""Config rules of agentic runs (called from :func:`relax_core.preflight.validation.validate` when rollout.env or
rollout.agent is set)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax_core.agentic.env import resolve_env_class
from relax_core.errors import RelaxUserError

if TYPE_CHECKING:
    from relax_core.config.schema import RelaxConfig

FAILED_SAMPLE_POLICIES = ["mask", "keep"]
# the endpoint's thread pool holds a waiting request of every program copy besides their model calls
MAX_AGENT_WORKERS = 16


def validate_agentic(cfg: RelaxConfig) -> None:
    r = cfg.rollout
    if not isinstance(r.env, dict):
        raise RelaxUserError("rollout.env must be a mapping with _target_ (or null for single-turn)")
    resolve_env_class(dict(r.env))
    if r.max_turns < 1:
        raise RelaxUserError(f"rollout.max_turns must be >= 1, got {r.max_turns}")
    if r.env_step_timeout_s <= 0:
        raise RelaxUserError(f"rollout.env_step_timeout_s must be > 0, got {r.env_step_timeout_s}")
    validate_episode_limits(cfg)


def validate_agent_program(cfg: RelaxConfig) -> None:
    """``rollout.agent``: an external program plays the episodes (relax_core/agentic/programs.py)."""
    r, agent = cfg.rollout, cfg.rollout.agent
    if r.env is not None:
        raise RelaxUserError("rollout.env and rollout.agent exclude each other: set one of them to null")
    if not agent.command or not all(isinstance(part, str) and part for part in agent.command):
        raise RelaxUserError(
            "rollout.agent.command must be the program as a list, e.g. [python, examples/agents/calc_agent.py]"
        )
    if not 1 <= agent.num_workers <= MAX_AGENT_WORKERS:
        raise RelaxUserError(
            f"rollout.agent.num_workers must be in 1..{MAX_AGENT_WORKERS}, got {agent.num_workers} "
            "(a program may run episodes concurrently itself)"
        )
    if agent.episode_timeout_s <= 0:
        raise RelaxUserError(f"rollout.agent.episode_timeout_s must be > 0, got {agent.episode_timeout_s}")
    if agent.max_restarts < 0:
        raise RelaxUserError(f"rollout.agent.max_restarts must be >= 0, got {agent.max_restarts}")
    validate_episode_limits(cfg)


def validate_episode_limits(cfg: RelaxConfig) -> None:
    r = cfg.rollout
    if r.failed_sample_policy not in FAILED_SAMPLE_POLICIES:
        raise RelaxUserError(
            f"rollout.failed_sample_policy={r.failed_sample_policy!r} is not one of {FAILED_SAMPLE_POLICIES}"
        )
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
