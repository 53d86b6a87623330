"""The interaction-environment interface of agentic (multi-turn) RL and the machinery that calls it safely.

An environment is one episode's world: :meth:`reset` may add an opening observation after the prompt, each
model turn goes to :meth:`step`, whose observation is appended to the context (loss-masked) before the
model's next turn. Environments are user code, so every call runs under a time limit in a daemon thread:
an environment that raises or hangs ends its own sample (status FAILED), never the run.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import threading
import time
from typing import Any

from relax_core.errors import RelaxUserError


class BaseInteractionEnv:
    """Subclass this; ``rollout.env._target_`` names the subclass, the other ``rollout.env`` keys are kwargs.

    One instance per sample. ``label`` / ``metadata`` are the dataset row's (the task), ``seed`` differs per
    sample so stochastic environments vary within a group. :meth:`step` and :meth:`reset` may be ``async``.
    A reward goes in ``info["reward"]`` (summed over the episode); without one the run's reward function
    scores the concatenated responses instead. ``info`` values that are numbers become per-step metrics.
    """

    def __init__(self, label: Any = None, metadata: dict[str, Any] | None = None, seed: int = 0) -> None:
        self.label = label
        self.metadata = metadata or {}
        self.seed = seed

    def reset(self) -> tuple[Any, dict[str, Any]]:
        """(opening observation or None, info); the observation follows the dataset prompt."""
        return None, {}

    def step(self, response_text: str) -> tuple[Any, bool, dict[str, Any]]:
        """React to one model turn: (observation, done, info)."""
        raise NotImplementedError

    def format_observation(self, observation: Any) -> dict[str, Any]:
        """The chat message an observation becomes: ``{"role", "content"[, "images"]}``.

        Images (PIL images, paths or arrays) are placed where ``content`` holds ``<image>`` markers, or
        before the text when it has none.
        """
        if isinstance(observation, dict) and "content" in observation:
            return {"role": "user", **observation}
        return {"role": "user", "content": str(observation)}

    def expert_action(self) -> str | None:
        """A demonstration turn for the supervised warm-start (None: nothing to say). Optional."""
        raise NotImplementedError(f"{type(self).__name__} has no expert_action()")

    def close(self) -> None:
        """Release what the episode holds (processes, sandboxes)."""


class EnvFailure(Exception):
    """An environment call raised (``kind="env_error"``) or ran past its limit (``kind="env_timeout"``)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def resolve_env_class(env_cfg: dict[str, Any]) -> type[BaseInteractionEnv]:
    """The class ``env_cfg["_target_"]`` names; a missing or wrong target is a user error naming it."""
    target = env_cfg.get("_target_") if isinstance(env_cfg, dict) else None
    if not target or not isinstance(target, str) or "." not in target:
        raise RelaxUserError("rollout.env needs _target_: a dotted path such as my_pkg.envs.MyEnv")
    module_name, _, attr = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise RelaxUserError(f"rollout.env._target_={target!r} cannot be imported: {err}") from None
    if not (inspect.isclass(cls) and issubclass(cls, BaseInteractionEnv)):
        raise RelaxUserError(
            f"rollout.env._target_={target!r} is not a subclass of relax_core.agentic.BaseInteractionEnv"
        )
    return cls


def env_kwargs(env_cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in env_cfg.items() if k != "_target_"}


def call_with_timeout(fn, *args: Any, timeout: float) -> Any:
    """``fn(*args)`` (awaited when it returns a coroutine) in a daemon thread, at most ``timeout`` seconds.

    Raises :class:`EnvFailure`. A hung call is abandoned (its thread is a daemon and cannot block exit).
    """
    result = call_many_with_timeout([(fn, args)], timeout)[0]
    if isinstance(result, EnvFailure):
        raise result
    return result


def call_many_with_timeout(calls: list[tuple[Any, tuple]], timeout: float) -> list[Any]:
    """Run the calls concurrently under one shared deadline; each entry of the answer is the call's result
    or an :class:`EnvFailure` (raised, or past the deadline)."""
    results: list[Any] = [None] * len(calls)
    done = [threading.Event() for _ in calls]

    def run(i: int, fn, args: tuple) -> None:
        try:
            value = fn(*args)
            if inspect.isawaitable(value):
                value = asyncio.run(_await(value))
            results[i] = value
        except Exception as err:  # noqa: BLE001  (user code: any exception ends that sample only)
            results[i] = EnvFailure("env_error", f"{type(err).__name__}: {err}")
        finally:
            done[i].set()

    for i, (fn, args) in enumerate(calls):
        threading.Thread(target=run, args=(i, fn, args), daemon=True, name=f"relax-env-{i}").start()
    deadline = time.monotonic() + timeout
    out: list[Any] = []
    for i, event in enumerate(done):
        if event.wait(max(deadline - time.monotonic(), 0.0)):
            out.append(results[i])
        else:
            out.append(EnvFailure("env_timeout", f"no answer within rollout.env_step_timeout_s={timeout}"))
    return out


async def _await(awaitable):
    return await awaitable
