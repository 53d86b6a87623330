"""The implementations a user picks by name in the config, one :class:`Option` per key.

Each implementation is a ``module:attribute`` path imported only when chosen, so ``rollout.engine=torch``
never imports vLLM's client and ``mode=colocate`` never imports TransferQueue. Clusters have their registry
in ``relax_launch/cluster``, algorithm pieces theirs in ``relax_core/algorithms/registry.py``.
"""

from __future__ import annotations

import importlib
from typing import Any

from relax_core.errors import RelaxUserError


class Option:
    """Config key ``key`` and its implementations, name -> ``module:attribute``."""

    def __init__(self, key: str, implementations: dict[str, str]) -> None:
        self.key = key
        self.implementations = implementations

    def names(self) -> list[str]:
        return list(self.implementations)

    def load(self, name: str) -> Any:
        """The implementation ``name`` names (imported now); one line naming the choices if there is none."""
        if name not in self.implementations:
            raise RelaxUserError(f"{self.key}={name!r} is not available; choose one of {self.names()}")
        module, _, attribute = self.implementations[name].partition(":")
        return getattr(importlib.import_module(module), attribute)
