"""The one place role classes become Ray actors: a group of replicas pinned to placement-group bundles."""

from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


class RoleGroup:
    """``replicas`` Ray actors of ``role_cls``; replica i lives in bundle ``bundles[i]`` of ``pg``.

    The role class itself knows nothing about Ray: its constructor gets ``*args`` and ``replica=i``
    when it accepts it, and every method is called through :meth:`call`.
    """

    def __init__(
        self,
        role_cls: type,
        name: str,
        replicas: int,
        pg: PlacementGroup,
        bundles: list[int],
        num_cpus: float,
        num_gpus: float,
        args: tuple = (),
        pass_replica: bool = False,
        env_vars: list[dict[str, str]] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        """``env_vars[i]``: extra environment of replica i (e.g. its ``torch.distributed`` rank);
        ``kwargs``: keyword arguments of every replica's constructor (e.g. the DataBus handle)."""
        self.name = name
        remote_cls = ray.remote(role_cls)
        self.restarts = [0] * replicas  # in-place restarts per replica (HealthManager)
        # ranks of one torch.distributed group: a replacement cannot join it, so losing one is a global restart
        self.collective = bool(env_vars) and replicas > 1

        def spawn(i: int, attempt: int = 0):
            return remote_cls.options(
                name=f"{name}-{i}" + (f"-r{attempt}" if attempt else ""),
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                max_concurrency=2,  # lets abort()/health() reach an actor that is busy generating
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=bundles[i]
                ),
                **({"runtime_env": {"env_vars": env_vars[i]}} if env_vars else {}),
            ).remote(*args, **(kwargs or {}), **({"replica": i} if pass_replica else {}))

        self._spawn = spawn
        self.actors = [spawn(i) for i in range(replicas)]

    def restart(self, i: int) -> Any:
        """Replace replica ``i`` (dead or hung) by a fresh actor in the same bundle; returns the new handle."""
        try:
            ray.kill(self.actors[i], no_restart=True)
        except Exception:  # already gone
            pass
        self.restarts[i] += 1
        self.actors[i] = self._spawn(i, self.restarts[i])
        return self.actors[i]

    def __len__(self) -> int:
        return len(self.actors)

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Call ``method`` on every replica with the same arguments."""
        return [getattr(a, method).remote(*args, **kwargs) for a in self.actors]

    def call_collective(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` on every replica and wait for all; returns replica 0's result.

        For groups whose replicas run collectives together (megatron TP ranks): waiting on every rank
        surfaces any rank's error and keeps the next call from overlapping this one on a slow rank.
        """
        return ray.get(self.call(method, *args, **kwargs))[0]

    def call_each(self, method: str, per_replica_args: list[tuple]) -> list[ray.ObjectRef]:
        """Call ``method`` on replica i with ``per_replica_args[i]``."""
        if len(per_replica_args) != len(self.actors):  # checked first: no replica may get a partial call
            raise ValueError(
                f"{self.name}.{method}: {len(per_replica_args)} argument tuples for {len(self.actors)} replicas"
            )
        return [
            getattr(a, method).remote(*args) for a, args in zip(self.actors, per_replica_args, strict=True)
        ]

    def kill(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
