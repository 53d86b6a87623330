"""Agentic RL: multi-turn episodes against interaction environments, with loss-masked observations.

Set ``rollout.env._target_`` to a :class:`BaseInteractionEnv` subclass and the Rollout role runs episodes
(:mod:`relax_core.agentic.multiturn`) instead of single-turn generation. The example tasks
(``data.synthetic=calc`` / ``guess``) are in :mod:`relax_core.agentic.tasks`.
"""

from relax_core.agentic.env import BaseInteractionEnv, EnvFailure
from relax_core.agentic.multiturn import MultiTurnRunner

__all__ = ["BaseInteractionEnv", "EnvFailure", "MultiTurnRunner"]
