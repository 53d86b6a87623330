"""The one place role classes become Ray actors: a group of replicas pinned to placement-group bundles.

Several groups can also share processes (:class:`SharedProcesses`): replica i of each of them is an object
of its own role class inside one Ray actor, reached through a :class:`RoleHandle` that is called like an
actor handle. Colocate uses it to run the Actor and its rollout engine in one process.

Without a placement group (``cluster=in_process``, no Ray) a group's replicas are objects in this process
behind :class:`~relax_core.runtime.handles.InProcessActor` handles.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from relax_core.runtime import handles
from relax_core.runtime.placement import gpu_env

if TYPE_CHECKING:
    import ray
    from ray.util.placement_group import PlacementGroup

# role methods that must reach a replica while another call keeps it busy (abort a generation, check it)
CONTROL_METHODS = frozenset({"health", "abort"})


def exit_quietly_when_signalled_late() -> None:
    """Make a SIGTERM that reaches this process while it exits end it at once.

    Ray's SIGTERM handler raises SystemExit on the main thread. An actor Ray is already ending gracefully
    (its handle dropped) runs its finalizers there; the launcher's ``ray.shutdown`` then signals it, and the
    SystemExit surfaces inside a finalizer as a traceback in the run's log. A live actor keeps Ray's handling.
    Call on the main thread (an actor's constructor runs there).
    """
    ray_handler = signal.getsignal(signal.SIGTERM)
    if not callable(ray_handler):
        return

    def on_sigterm(signum: int, frame: Any) -> None:
        if sys.is_finalizing() or not threading.main_thread().is_alive():
            os._exit(1)
        ray_handler(signum, frame)

    signal.signal(signal.SIGTERM, on_sigterm)


def actor_class(role_cls: type) -> type:
    """``role_cls`` as a Ray actor's class: the same class, whose process first calls
    :func:`exit_quietly_when_signalled_late`. Its constructor keeps the role's signature, which Ray checks
    arguments against before it starts the process."""

    @functools.wraps(role_cls.__init__)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        exit_quietly_when_signalled_late()
        role_cls.__init__(self, *args, **kwargs)

    return type(role_cls.__name__, (role_cls,), {"__init__": __init__, "__qualname__": role_cls.__name__})


class RoleGroup:
    """``replicas`` Ray actors of ``role_cls``; replica i lives in bundle ``bundles[i]`` of ``pg`` (``pg``
    None: objects in this process).

    The role class itself knows nothing about Ray: its constructor gets ``*args`` and ``replica=i``
    when it accepts it, and every method is called through :meth:`call`.
    """

    def __init__(
        self,
        role_cls: type,
        name: str,
        replicas: int,
        pg: PlacementGroup | None,
        bundles: list[int],
        num_cpus: float,
        num_gpus: float,
        args: tuple = (),
        pass_replica: bool = False,
        env_vars: list[dict[str, str]] | None = None,
        kwargs: dict[str, Any] | None = None,
        shared: SharedProcesses | None = None,
        max_concurrency: int = 2,
        threaded: bool = False,
    ) -> None:
        """``env_vars[i]``: extra environment of replica i (e.g. its ``torch.distributed`` rank);
        ``kwargs``: keyword arguments of every replica's constructor (e.g. the DataBus handle);
        ``shared``: replica i lives in process i of these shared processes instead of its own actor;
        ``max_concurrency``: calls one actor runs at once (the default lets abort()/health() reach an actor
        that is busy generating); ``threaded`` (``pg`` None): each replica runs its calls on that many
        threads of its own instead of in the caller's (mode=async in one process: roles work side by side)."""
        self.name = name
        if pg is not None:  # Ray is imported only here: cluster=in_process runs where it is not installed
            import ray
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            remote_cls = ray.remote(actor_class(role_cls))
        self.restarts = [0] * replicas  # in-place restarts per replica (HealthManager)
        self.pg = pg  # a replica restarted in place waits for its bundle (HealthManager)
        # ranks of one torch.distributed group: a replacement cannot join it, so losing one is a global restart
        self.collective = bool(env_vars) and replicas > 1
        self.shared = shared
        hide = gpu_env(num_gpus) if pg is not None and shared is None else {}  # a role given no GPU sees none

        def spawn(i: int, attempt: int = 0):
            if pg is None:
                return handles.InProcessActor(
                    role_cls(*args, **(kwargs or {}), **({"replica": i} if pass_replica else {})),
                    threads=max_concurrency if threaded else 0,
                    name=f"{name}-{i}",
                )
            if shared is not None:
                role_kwargs = (kwargs or {}) | ({"replica": i} if pass_replica else {})
                env = env_vars[i] if env_vars else {}
                return shared.join(
                    name, i, RoleSpec(role_cls, args, role_kwargs, num_cpus, num_gpus, bundles[i], env)
                )
            env = (env_vars[i] if env_vars else {}) | hide
            return remote_cls.options(
                name=f"{name}-{i}" + (f"-r{attempt}" if attempt else ""),
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                max_concurrency=max_concurrency,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=bundles[i]
                ),
                **({"runtime_env": {"env_vars": env}} if env else {}),
            ).remote(*args, **(kwargs or {}), **({"replica": i} if pass_replica else {}))

        self._spawn = spawn
        self.actors = [spawn(i) for i in range(replicas)]

    def restart(self, i: int) -> Any:
        """Replace replica ``i`` (dead or hung) by a fresh actor in the same bundle; returns the new handle."""
        if (
            self.shared is not None
        ):  # the process holds other roles' state too: they go (and come back) together
            raise RuntimeError(
                f"{self.name}-{i} shares its process with {self.shared.roles}; it cannot restart alone"
            )
        try:
            self.kill_replica(i)
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
        return handles.get(self.call(method, *args, **kwargs))[0]

    def call_each(self, method: str, per_replica_args: list[tuple]) -> list[ray.ObjectRef]:
        """Call ``method`` on replica i with ``per_replica_args[i]``."""
        if len(per_replica_args) != len(self.actors):  # checked first: no replica may get a partial call
            raise ValueError(
                f"{self.name}.{method}: {len(per_replica_args)} argument tuples for {len(self.actors)} replicas"
            )
        return [
            getattr(a, method).remote(*args) for a, args in zip(self.actors, per_replica_args, strict=True)
        ]

    def kill_replica(self, i: int) -> None:
        """Kill the process of replica ``i`` (a shared process takes its other roles with it)."""
        handles.kill(self.shared.host(i) if self.shared is not None else self.actors[i])

    def kill(self) -> None:
        if self.shared is not None:
            self.shared.kill()
            return
        for actor in self.actors:
            handles.kill(actor)


@dataclass
class RoleSpec:
    """How one role's replica is built and what it reserves."""

    role_cls: type
    args: tuple
    kwargs: dict[str, Any]
    num_cpus: float
    num_gpus: float
    bundle: int
    env: dict[str, str]


class SharedProcesses:
    """Processes that each hold replica i of several roles (``roles``, in construction order).

    Every role's :class:`RoleGroup` joins with its class and arguments; once all have joined, process i
    is one Ray actor (:class:`Colocated`) that builds the roles' objects in that order, with the sum of
    their resources in the first role's bundle. The process's death is every member role's death.
    """

    def __init__(self, pg: PlacementGroup, name: str, roles: list[str]) -> None:
        self.pg, self.name, self.roles = pg, name, roles
        self._specs: dict[int, dict[str, RoleSpec]] = {}  # replica -> role -> spec
        self._hosts: dict[int, Any] = {}

    def join(self, role: str, i: int, spec: RoleSpec) -> RoleHandle:
        if role not in self.roles:
            raise ValueError(f"{role} is not one of the roles sharing {self.name}: {self.roles}")
        self._specs.setdefault(i, {})[role] = spec
        return RoleHandle(self, i, role)

    def host(self, i: int) -> Any:
        """The Ray actor of process ``i`` (started at first use, when every role has joined)."""
        if i not in self._hosts:
            specs = self._specs.get(i, {})
            missing = [r for r in self.roles if r not in specs]
            if missing:
                raise RuntimeError(f"{self.name}-{i} is used before {missing} joined it")
            ordered = [specs[r] for r in self.roles]
            num_gpus = max(spec.num_gpus for spec in ordered)
            env = {k: v for spec in ordered for k, v in spec.env.items()} | gpu_env(num_gpus)
            import ray
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            self._hosts[i] = (
                ray.remote(Colocated)
                .options(
                    name=f"{self.name}-{i}",
                    num_cpus=sum(spec.num_cpus for spec in ordered),
                    num_gpus=num_gpus,
                    max_concurrency=2,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.pg, placement_group_bundle_index=ordered[0].bundle
                    ),
                    **({"runtime_env": {"env_vars": env}} if env else {}),
                )
                .remote({r: (specs[r].role_cls, specs[r].args, specs[r].kwargs) for r in self.roles})
            )
        return self._hosts[i]

    def kill(self) -> None:
        import ray

        for host in self._hosts.values():
            try:
                ray.kill(host, no_restart=True)
            except Exception:  # already gone
                pass


class Colocated:
    """One process holding several roles' objects, built in order from the plain role classes.

    Their work runs on one thread of the process. torch's OpenMP thread pool belongs to the thread that
    calls it; once two threads have used torch (Ray hands calls to either thread of the actor), libgomp
    sees more pool threads than cores and stops spin-waiting between ops, so each op pays a thread wake-up.
    Measured on 2 cores: forward and backward at 1.3 cores instead of 1.95 (~1.6x slower), the default
    experiment's step 0.345 -> 0.290 s once all calls run on one thread. Calls that must reach a busy role
    (:data:`CONTROL_METHODS`) skip the queue.
    """

    def __init__(self, roles: dict[str, tuple[type, tuple, dict[str, Any]]]) -> None:
        exit_quietly_when_signalled_late()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relax-roles")
        build = lambda: {name: cls(*args, **kwargs) for name, (cls, args, kwargs) in roles.items()}  # noqa: E731
        self.roles = self._worker.submit(build).result()

    def call_role(self, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
        bound = getattr(self.roles[role], method)
        if method in CONTROL_METHODS:
            return bound(*args, **kwargs)
        return self._worker.submit(bound, *args, **kwargs).result()


class RoleHandle:
    """Replica ``i`` of ``role`` inside a shared process, called like an actor handle
    (``handle.method.remote(...)``, ``.options(...)``); Ray's own ``__ray_*__`` calls reach the process."""

    def __init__(self, shared: SharedProcesses, i: int, role: str) -> None:
        self.shared, self.i, self.role = shared, i, role

    def __getattr__(self, method: str) -> Any:
        if method.startswith("__ray"):
            return getattr(self.shared.host(self.i), method)
        if method.startswith("_"):  # pickling and other protocol lookups: not role methods
            raise AttributeError(method)
        return RoleMethod(self, method)


class RoleMethod:
    def __init__(self, handle: RoleHandle, method: str, options: dict[str, Any] | None = None) -> None:
        self.handle, self.method, self._options = handle, method, options or {}

    def options(self, **options: Any) -> RoleMethod:
        return RoleMethod(self.handle, self.method, self._options | options)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        call = self.handle.shared.host(self.handle.i).call_role
        if self._options:
            call = call.options(**self._options)
        return call.remote(self.handle.role, self.method, *args, **kwargs)
