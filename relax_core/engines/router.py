"""Request router across rollout engines: least outstanding work, prompt groups kept whole, health-aware.

A *group* (one prompt and its ``n`` samples) always goes to one engine, so its samples share a prefill and
a policy version. Each group goes to the routable engine with the fewest outstanding samples (ties: the
engine registered first). Engines that fail a health check or a call stop being routable; a later passing
health check makes them routable again. Draining engines (scale-in) take no new work.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass


@dataclass
class RouteState:
    key: Hashable
    outstanding: int = 0
    healthy: bool = True
    draining: bool = False
    failures: int = 0

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining


class Router:
    """Thread-safe bookkeeping of engines' outstanding samples; it never calls an engine itself."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engines: dict[Hashable, RouteState] = {}

    def add(self, key: Hashable) -> None:
        with self._lock:
            self._engines.setdefault(key, RouteState(key))

    def remove(self, key: Hashable) -> None:
        with self._lock:
            self._engines.pop(key, None)

    def keys(self, routable_only: bool = False) -> list[Hashable]:
        with self._lock:
            return [k for k, s in self._engines.items() if s.routable or not routable_only]

    def state(self, key: Hashable) -> RouteState | None:
        return self._engines.get(key)

    def set_draining(self, key: Hashable, draining: bool = True) -> None:
        with self._lock:
            if key in self._engines:
                self._engines[key].draining = draining

    def mark_unhealthy(self, key: Hashable) -> None:
        with self._lock:
            if key in self._engines:
                self._engines[key].healthy = False
                self._engines[key].failures += 1

    def mark_healthy(self, key: Hashable) -> None:
        with self._lock:
            if key in self._engines:
                self._engines[key].healthy = True

    def assign(self, group_sizes: list[int], exclude: set[Hashable] | None = None) -> list[Hashable]:
        """Engine for each group (in order), least outstanding first; counts the groups as outstanding."""
        with self._lock:
            candidates = [s for k, s in self._engines.items() if s.routable and k not in (exclude or set())]
            if not candidates:
                raise RuntimeError("no healthy rollout engine to route to")
            chosen = []
            for size in group_sizes:
                best = min(candidates, key=lambda s: s.outstanding)
                best.outstanding += size
                chosen.append(best.key)
            return chosen

    def release(self, key: Hashable, size: int) -> None:
        with self._lock:
            if key in self._engines:
                self._engines[key].outstanding = max(0, self._engines[key].outstanding - size)

    def outstanding(self, key: Hashable) -> int:
        with self._lock:
            state = self._engines.get(key)
            return state.outstanding if state else 0

    def check_health(self, probe: Callable[[Hashable], bool], drop_after: int = 1) -> dict[Hashable, bool]:
        """Probe every engine; drop an engine from routing after ``drop_after`` failed probes in a row
        (a busy engine may answer late once), and route to a recovered one again at its first success."""
        results = {}
        for key in self.keys():
            try:
                ok = bool(probe(key))
            except Exception:
                ok = False
            with self._lock:
                state = self._engines.get(key)
                if state is None:
                    continue
                state.failures = 0 if ok else state.failures + 1
                state.healthy = ok or (state.healthy and state.failures < drop_after)
            results[key] = ok
        return results
