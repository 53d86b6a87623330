"""Reward executor: dispatch each sample to its reward, run with timeouts, isolate failures.

One bad sample (a reward that raises, hangs or returns garbage) costs that sample a 0.0 reward and an
error string in its outcome; the rest of the batch is scored normally and later batches are not slowed
down. This is what lets a long RL run survive a flaky verifier or a pathological response.

Dispatch per sample: ``metadata["rm_type"]`` if present, else ``cfg._target_``, else ``cfg.name``. An
``rm_type`` comes from the dataset, so it may only name a registered reward (built-ins and whatever the
``cfg.plugins`` modules register) or repeat ``cfg._target_``; it never loads code by itself. A dict-valued reward yields its scalar from ``cfg.key`` when the
reward is the configured one, else from the key it was registered with, else ``"score"``; its other
numeric entries become ``extras`` (non-numeric entries such as a predicted string are dropped).
``cfg.kwargs`` go to the configured reward as keyword arguments (checked against its signature up
front); a reward chosen by ``rm_type`` gets only the kwargs its signature accepts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import math
import numbers
import pickle
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from relax_rewards._pool import Call, InProcessRunner, ProcessPoolRunner, Status
from relax_rewards.config import RewardConfig
from relax_rewards.plugins import file_target, import_plugin, is_file_target, is_group_reward, load_custom
from relax_rewards.registry import _REGISTRY, get_entry

log = logging.getLogger("relax_rewards.executor")

_START_METHODS = ("spawn", "forkserver", "fork")


@dataclass
class RewardItem:
    """One response to score. ``group_id`` ties the samples of one prompt together (group rewards)."""

    sample_id: str
    response: str
    label: Any
    metadata: dict[str, Any] | None = None
    group_id: int = 0


@dataclass
class RewardOutcome:
    """The scalar training reward, numeric side metrics, and why it failed (``"timeout"`` or
    ``"exception: <msg>"``; the reward is then 0.0)."""

    reward: float
    extras: dict[str, float] = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True)
class _Resolved:
    name: str
    fn: Callable[..., Any]
    ref: tuple[str, Any]
    key: str
    group: bool
    kwargs: dict[str, Any]


def _config_from(cfg: Any) -> RewardConfig:
    """A RewardConfig from a RewardConfig, an OmegaConf DictConfig or a plain mapping."""
    if isinstance(cfg, RewardConfig):
        return cfg
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency, but the hub does not need it
        pass
    if not isinstance(cfg, Mapping):
        raise TypeError(f"reward config must be a RewardConfig, DictConfig or dict, got {type(cfg).__name__}")
    known = [f.name for f in dataclasses.fields(RewardConfig)]
    unknown = sorted(set(cfg) - set(known))
    if unknown:
        raise ValueError(f"reward config has unknown field(s) {unknown}; known fields: {known}")
    return RewardConfig(**dict(cfg))


def _validate(cfg: RewardConfig) -> None:
    if not isinstance(cfg.num_workers, int) or isinstance(cfg.num_workers, bool) or cfg.num_workers < 0:
        raise ValueError(f"reward.num_workers must be an integer >= 0, got {cfg.num_workers!r}")
    if not isinstance(cfg.concurrency, int) or isinstance(cfg.concurrency, bool) or cfg.concurrency < 1:
        raise ValueError(f"reward.concurrency must be an integer >= 1, got {cfg.concurrency!r}")
    if (
        not isinstance(cfg.timeout_s, int | float)
        or not cfg.timeout_s > 0
        or not math.isfinite(cfg.timeout_s)
    ):
        raise ValueError(f"reward.timeout_s must be a positive number of seconds, got {cfg.timeout_s!r}")
    if not cfg._target_ and not cfg.name:
        raise ValueError("reward config needs a name (a registered reward) or a _target_ (a custom reward)")
    if not isinstance(cfg.kwargs, Mapping):
        raise ValueError(f"reward.kwargs must be a mapping, got {type(cfg.kwargs).__name__}")
    if isinstance(cfg.plugins, str) or not all(isinstance(p, str) for p in cfg.plugins):
        raise ValueError(f"reward.plugins must be a list of module names or .py paths, got {cfg.plugins!r}")
    if cfg.start_method not in _START_METHODS:
        raise ValueError(f"reward.start_method must be one of {_START_METHODS}, got {cfg.start_method!r}")


def _accepted_kwargs(fn: Callable[..., Any]) -> set[str] | None:
    """Keyword names ``fn`` accepts beyond (response, label, metadata); None means any (``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    params = list(params)
    # the first three parameters receive (response, label, metadata) or their per-group lists
    positional = [p for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY][:3]
    return {
        p.name
        for p in params
        if p not in positional
        and p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    }


def _to_float(value: Any) -> float | None:
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "__float__") and not isinstance(value, str | bytes):
        try:
            return float(value)  # 0-d numpy / torch values
        except (TypeError, ValueError):
            return None
    return None


def _outcome(value: Any, key: str) -> RewardOutcome:
    """Turn a reward's return value into an outcome (an error outcome when it is malformed)."""
    if isinstance(value, Mapping):
        if key not in value:
            return RewardOutcome(
                0.0, {}, f"exception: reward returned a dict without key {key!r} (keys: {sorted(value)})"
            )
        reward = _to_float(value[key])
        extras = {}
        for k, v in value.items():
            f = _to_float(v)
            if k != key and f is not None and math.isfinite(f):
                extras[str(k)] = f
    else:
        reward, extras = _to_float(value), {}
    if reward is None:
        shown = value[key] if isinstance(value, Mapping) else value
        return RewardOutcome(
            0.0, {}, f"exception: reward returned {type(shown).__name__}, expected a number or a dict"
        )
    if not math.isfinite(reward):
        return RewardOutcome(0.0, {}, f"exception: reward returned a non-finite value {reward}")
    return RewardOutcome(reward, extras, None)


class RewardExecutor:
    """Scores batches of :class:`RewardItem` with per-call timeouts and failure isolation.

    The calls of a batch run concurrently (up to ``cfg.concurrency`` per process), each against its own
    deadline of ``cfg.timeout_s`` from its start: a batch whose rewards all hang costs about one timeout.

    ``num_workers > 0`` (the default) runs them in that many worker processes and isolates the run from
    its rewards: a worker with an overrunning call is killed and replaced, and a reward that calls
    ``os._exit`` or crashes its process (segfault) scores 0.0 with an error for its own samples only.
    ``num_workers == 0`` runs them on daemon threads of this process (for rewards that cannot be
    pickled, or debugging): an overrunning call is abandoned, not killed (it keeps its thread), and a
    reward that exits or crashes ends this process. A per-group reward is called once per (reward,
    ``group_id``) and the timeout covers that whole call. ``score`` is thread-safe (calls are serialised).
    """

    def __init__(self, cfg: RewardConfig) -> None:
        _validate(cfg)
        self.cfg = cfg
        self.default_name: str = cfg._target_ or cfg.name
        self._resolved: dict[str, _Resolved] = {}
        self._lock = threading.Lock()
        self._counts = {"num_samples": 0, "num_calls": 0, "num_errors": 0, "num_timeouts": 0}
        self._time_s = 0.0
        for plugin in cfg.plugins:
            import_plugin(plugin)
        default = self._resolve(self.default_name)
        accepted = _accepted_kwargs(default.fn)
        if accepted is not None:
            bad = sorted(set(cfg.kwargs) - accepted)
            if bad:
                raise ValueError(
                    f"reward {self.default_name!r} does not accept kwargs {bad}; its options: {', '.join(sorted(accepted)) or 'none'}"
                )
        self._runner: InProcessRunner | ProcessPoolRunner
        if cfg.num_workers == 0:
            self._runner = InProcessRunner(cfg.concurrency)
        else:
            try:
                pickle.dumps((default.ref, default.kwargs))
            except Exception as e:
                raise ValueError(
                    f"reward {self.default_name!r} cannot be sent to worker processes ({e}); define it at module "
                    "level in an importable module, or use reward.num_workers=0"
                ) from e
            self._runner = ProcessPoolRunner(cfg.num_workers, cfg.start_method, cfg.concurrency)

    @classmethod
    def from_config(cls, cfg: RewardConfig | Mapping[str, Any] | Any) -> RewardExecutor:
        """Build from a RewardConfig, or a DictConfig/dict with the same fields."""
        return cls(_config_from(cfg))

    # ------------------------------------------------------------------------------ dispatch

    def _resolve(self, name: str) -> _Resolved:
        """The reward for a selector: a registered name, or the configured custom target.

        A sample's ``rm_type`` is data, so it may only pick registered rewards (or repeat the configured
        target); loading code from a path or module named in a dataset row is refused.
        """
        cached = self._resolved.get(name)
        if cached is not None:
            return cached
        if name in _REGISTRY:
            entry = get_entry(name)
            fn, key, group = entry.fn, entry.key, entry.group
            # functions from file-loaded plug-ins are reloaded by path in worker processes
            file_ref = file_target(fn)
            ref: tuple[str, Any] = ("target", file_ref) if file_ref else ("fn", fn)
        elif name == self.default_name and ("." in name or ":" in name):
            fn = load_custom(name)
            # a file-loaded module has no importable name, so workers load it themselves from the target
            ref = ("target", name) if is_file_target(name) else ("fn", fn)
            key, group = None, is_group_reward(fn)
        else:
            get_entry(name)  # raises, listing the available names
            raise AssertionError("unreachable")
        if name == self.default_name:
            kwargs = dict(self.cfg.kwargs)
            key = self.cfg.key or key
        else:
            accepted = _accepted_kwargs(fn)
            kwargs = {k: v for k, v in self.cfg.kwargs.items() if accepted is None or k in accepted}
        resolved = _Resolved(name=name, fn=fn, ref=ref, key=key or "score", group=group, kwargs=kwargs)
        self._resolved[name] = resolved
        return resolved

    def _selector(self, item: RewardItem) -> str:
        md = item.metadata
        if isinstance(md, Mapping):
            rm_type = md.get("rm_type")
            if isinstance(rm_type, str) and rm_type.strip():
                return rm_type.strip()
        return self.default_name

    # ------------------------------------------------------------------------------ scoring

    def score(self, items: Sequence[RewardItem]) -> list[RewardOutcome]:
        """One outcome per item, in order. Never raises for a failing reward."""
        for item in items:
            if not isinstance(item, RewardItem):
                raise TypeError(f"RewardExecutor.score expects RewardItem objects, got {type(item).__name__}")
        with self._lock:
            return self._score(items)

    def _score(self, items: Sequence[RewardItem]) -> list[RewardOutcome]:
        outcomes: list[RewardOutcome | None] = [None] * len(items)
        calls: list[Call] = []
        targets: list[tuple[_Resolved, list[int]]] = []
        groups: dict[tuple[str, Any], list[int]] = {}
        for i, item in enumerate(items):
            try:
                res = self._resolve(self._selector(item))
            except Exception as e:  # a bad rm_type is the sample's problem, not the batch's
                outcomes[i] = RewardOutcome(0.0, {}, f"exception: {e}")
                continue
            if res.group:
                groups.setdefault((res.name, item.group_id), []).append(i)
            else:
                calls.append(Call(res.fn, res.ref, (item.response, item.label, item.metadata), res.kwargs))
                targets.append((res, [i]))
        for (name, _), idxs in groups.items():
            res = self._resolved[name]
            args = (
                [items[i].response for i in idxs],
                [items[i].label for i in idxs],
                [items[i].metadata for i in idxs],
            )
            calls.append(Call(res.fn, res.ref, args, res.kwargs))
            targets.append((res, idxs))

        t0 = time.perf_counter()
        statuses = self._runner.run(calls, float(self.cfg.timeout_s)) if calls else []
        self._time_s += time.perf_counter() - t0
        for status, (res, idxs) in zip(statuses, targets, strict=True):
            for i, out in zip(idxs, self._outcomes(status, res, len(idxs)), strict=True):
                outcomes[i] = out
        self._counts["num_samples"] += len(items)
        self._counts["num_calls"] += len(calls)
        final = [o if o is not None else RewardOutcome(0.0, {}, "exception: not scored") for o in outcomes]
        for item, out in zip(items, final, strict=True):
            if out.error is None:
                continue
            name = self._selector(item)
            if out.error == "timeout":
                self._counts["num_timeouts"] += 1
                log.warning(
                    "reward %r timed out after %.1f s on sample %s", name, self.cfg.timeout_s, item.sample_id
                )
            else:
                self._counts["num_errors"] += 1
                log.warning("reward %r failed on sample %s: %s", name, item.sample_id, out.error)
        return final

    def _outcomes(self, status: Status, res: _Resolved, n: int) -> list[RewardOutcome]:
        kind, value = status
        if kind == "timeout":
            return [RewardOutcome(0.0, {}, "timeout") for _ in range(n)]
        if kind != "ok":
            return [RewardOutcome(0.0, {}, f"exception: {value}") for _ in range(n)]
        if not res.group:
            return [_outcome(value, res.key)]
        if not isinstance(value, list | tuple) or len(value) != n:
            got = f"a list of {len(value)}" if isinstance(value, list | tuple) else type(value).__name__
            err = f"exception: group reward {res.name!r} returned {got}, expected a list of {n} rewards"
            return [RewardOutcome(0.0, {}, err) for _ in range(n)]
        return [_outcome(v, res.key) for v in value]

    async def ascore(self, items: Sequence[RewardItem]) -> list[RewardOutcome]:
        """``score`` for async callers: runs in a thread so the event loop keeps serving."""
        return await asyncio.to_thread(self.score, items)

    def stats(self) -> dict[str, float]:
        """Cumulative counters for metrics: samples, calls, errors (raised/malformed), timeouts,
        worker restarts, abandoned in-process threads, and seconds spent scoring."""
        with self._lock:
            out: dict[str, float] = dict(self._counts)
            out["num_worker_restarts"] = getattr(self._runner, "num_restarts", 0)
            out["num_abandoned_threads"] = getattr(self._runner, "num_abandoned_threads", 0)
            out["time_s"] = self._time_s
        return out

    def close(self) -> None:
        """Stop worker processes (idempotent)."""
        runner = getattr(self, "_runner", None)
        if isinstance(runner, ProcessPoolRunner):
            runner.close()

    def __enter__(self) -> RewardExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
