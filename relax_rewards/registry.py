"""Name -> reward function registry behind ``relax_rewards.get`` / ``available`` / ``register``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from relax_rewards.plugins import is_group_reward

RewardFn = Callable[..., Any]


@dataclass(frozen=True)
class RewardEntry:
    """A registered reward: the function, the dict entry used as the scalar, and whether it is per-group."""

    name: str
    fn: RewardFn
    key: str | None = None
    group: bool = False
    # scores against the sample's label (the dataset's data.label_key column)
    needs_label: bool = False
    # kwargs of which the config must give at least one (e.g. a judge's url)
    needs_one_of: tuple[str, ...] = ()
    # launch check fn(reward.kwargs) raising ValueError in one line when this machine cannot score
    check: Callable[[dict[str, Any]], None] | None = None


_REGISTRY: dict[str, RewardEntry] = {}


class UnknownRewardError(KeyError):
    """A reward name that is not registered; the message lists the registered ones."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown reward"


def _same_function(a: RewardFn, b: RewardFn) -> bool:
    # a module imported twice (e.g. by path and by package) gives a new object for the same function
    return a is b or (
        getattr(a, "__module__", None) == getattr(b, "__module__", None)
        and getattr(a, "__qualname__", None) == getattr(b, "__qualname__", None)
    )


def register(
    name: str,
    *,
    key: str | None = None,
    group: bool | None = None,
    needs_label: bool = False,
    needs_one_of: tuple[str, ...] = (),
    check: Callable[[dict[str, Any]], None] | None = None,
) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering ``fn`` under ``name``.

    ``key`` names the entry of a dict-valued reward used as the scalar when the config gives none;
    ``group=True`` (or a function marked with ``@group_reward``) means it scores one prompt group at
    a time: ``fn(responses, labels, metadatas) -> list``. ``needs_label`` and ``needs_one_of`` (kwargs
    of which one must be configured) and ``check(kwargs)`` let a run that cannot score stop at start
    (:mod:`relax_rewards.preflight`).
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"reward name must be a non-empty string, got {name!r}")

    def deco(fn: RewardFn) -> RewardFn:
        if not callable(fn):
            raise TypeError(f"reward {name!r}: {fn!r} is not callable")
        old = _REGISTRY.get(name)
        if old is not None and not _same_function(old.fn, fn):
            raise ValueError(
                f"reward name {name!r} is already registered to {old.fn.__module__}.{old.fn.__qualname__}"
            )
        is_group = is_group_reward(fn) if group is None else group
        _REGISTRY[name] = RewardEntry(name, fn, key, is_group, needs_label, tuple(needs_one_of), check)
        return fn

    return deco


def get_entry(name: str) -> RewardEntry:
    """The registry entry for ``name``; unknown names raise KeyError listing the available ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownRewardError(
            f"unknown reward {name!r}; available rewards: {', '.join(available())}"
        ) from None


def get(name: str) -> RewardFn:
    """The reward function registered as ``name``."""
    return get_entry(name).fn


def available() -> list[str]:
    """Sorted names of all registered rewards."""
    return sorted(_REGISTRY)
