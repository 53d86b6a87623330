"""Name -> function (or spec) registries; an algorithm config picks its pieces from these by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F")


class Registry(Generic[F]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._fns: dict[str, F] = {}

    def add(self, name: str, fn: F) -> F:
        if name in self._fns:
            raise ValueError(f"{self.kind} {name!r} registered twice")
        self._fns[name] = fn
        return fn

    def register(self, *names: str) -> Callable[[F], F]:
        def decorate(fn: F) -> F:
            for name in names:
                self.add(name, fn)
            return fn

        return decorate

    def get(self, name: str) -> F:
        if name not in self._fns:
            raise KeyError(f"unknown {self.kind} {name!r}; choose one of {sorted(self._fns)}")
        return self._fns[name]

    def names(self) -> list[str]:
        return sorted(self._fns)


ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator")
POLICY_LOSSES: Registry = Registry("policy loss")
KL_ESTIMATORS: Registry = Registry("KL estimator")
LOSS_AGGREGATIONS: Registry = Registry("loss aggregation")
