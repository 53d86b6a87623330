"""What every mode is: a scheduler over the same role classes.

A mode places the roles (``start``), moves weights between them (``publish``), generates for evaluation
(``generate``) and runs RL steps (``steps``). The run loop (relax_core/run_loop.py) owns everything around
the steps — data, warm-start, evaluation, checkpoints, health — and reaches the roles only through
:class:`RoleGroups`.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from relax_core.algorithms.spec import Requirements
from relax_core.data.prompts import PromptStream
from relax_core.engines.base import SamplingParams
from relax_core.runtime.groups import RoleGroup
from relax_core.runtime.placement import actor_world_size
from relax_core.samples import PromptRecord, Sample

if TYPE_CHECKING:
    from relax_core.config.schema import RelaxConfig

StepMetrics = dict[str, float]


@dataclass
class RoleGroups:
    """Every role group of a run. Health and checkpointing get this object, never the mode."""

    rollout: RoleGroup | None = None
    actor: RoleGroup | None = None
    actor_fwd: RoleGroup | None = None
    reference: RoleGroup | None = None
    critic: RoleGroup | None = None
    teacher: RoleGroup | None = None
    advantages: RoleGroup | None = None

    def all(self) -> dict[str, RoleGroup]:
        """The groups that run, by role name."""
        return {f.name: g for f in fields(self) if (g := getattr(self, f.name)) is not None}


@dataclass
class RunContext:
    """What the run loop prepares for the mode: config, model folder, tokenizer, prompts, plan."""

    cfg: Any
    model_path: str
    tokenizer: Any
    stream: PromptStream
    needs: Requirements
    teacher_path: str | None = None


class Mode(abc.ABC):
    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.roles = RoleGroups()
        self.transfer = None  # WeightTransfer, built by start()
        # set by the run loop before steps(): in-place recovery of dead replicas
        self.health = None
        # set by the run loop: a checkpoint folder of the Reference's weights when they are not the model
        # folder's (warm-started), which a Reference restarted in place loads
        self.reference_copy: str | None = None
        # set by the run loop: whether a checkpoint is due after a step (a mode with steps in flight holds
        # its stateful roles at that step until the checkpoint is written)
        self.checkpoint_due: Callable[[int], bool] = lambda step: False
        self.judge = None  # reward.judge: the genrm judge engines (relax_core/rollout/judge.py)

    @abc.abstractmethod
    def start(self) -> RoleGroups:
        """Place and start every role group, connect the weight transfer."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Kill every role group and release placement groups and buses."""

    @abc.abstractmethod
    def generate(
        self, prompts: list[PromptRecord], greedy: bool = False, sampling: SamplingParams | None = None
    ) -> list[Sample]:
        """Scored samples of ``prompts`` from the rollout engines (evaluation uses ``greedy``, or its own
        ``sampling`` with a seed, which leaves the training sampling stream untouched)."""

    @abc.abstractmethod
    def publish(self, version: int) -> None:
        """Blocking: every weight consumer holds policy version ``version``."""

    @abc.abstractmethod
    def steps(self, first: int, evaluate: Callable[[int], StepMetrics]) -> Iterator[tuple[int, StepMetrics]]:
        """Run RL steps ``first``..``trainer.total_steps``; yield ``(step, metrics)`` in order. ``evaluate``
        (of a step) is called by modes that must evaluate at a point of their own schedule (async)."""

    def start_judge(self) -> None:
        """``reward.judge``: start the judge engines first, so the reward workers get their URL."""
        if self.cfg.reward.judge is None or not self.cfg.reward.judge.managed:
            return  # relax_core.rollout.judge (and its HTTP server's packages) loads only for a managed judge
        from relax_core.rollout.judge import start_judge

        self.judge = start_judge(self.cfg)

    def stop_judge(self) -> None:
        if self.judge is not None:
            self.judge.stop()
            self.judge = None

    def replaced(self, role: str, index: int, handle: Any) -> None:
        """A replica of ``role`` was restarted in place: bring it to the weights it held (modes add the
        policy followers)."""
        if role == "reference" and self.reference_copy is not None:
            from relax_core.runtime import handles

            handles.get(handle.load_checkpoint.remote(self.reference_copy))

    def stream_state(self) -> dict[str, Any]:
        """Data position a checkpoint after the last yielded step resumes from (async modes have drawn the
        prompts of later steps already)."""
        return self.ctx.stream.state_dict()

    def state_dict(self) -> dict[str, Any]:
        """Scheduler state that a checkpoint keeps (e.g. async's sample counts)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def metrics(self) -> StepMetrics:
        return {}


def split_evenly(items: list, parts: int) -> list[list]:
    """``items`` in ``parts`` contiguous chunks whose sizes differ by at most one."""
    size, extra = divmod(len(items), parts)
    chunks, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        chunks.append(items[start:end])
        start = end
    return chunks


ERROR_EXAMPLE = "reward/error_example"


def reward_metrics(samples: list[Sample], prefix: str = "reward") -> StepMetrics:
    import torch

    rewards = torch.tensor([s.reward for s in samples])
    out = {f"{prefix}/mean": float(rewards.mean()), f"{prefix}/std": float(rewards.std(unbiased=False))}
    extra_keys = {k for s in samples for k in s.reward_extras}
    for key in sorted(extra_keys):
        out[f"{prefix}/{key}"] = sum(s.reward_extras.get(key, 0.0) for s in samples) / len(samples)
    failed = [s for s in samples if s.reward_extras.get("reward_error")]
    out[f"{prefix}/errors"] = float(len(failed))
    example = next((s for s in failed if (s.metadata or {}).get("reward_error")), None)
    if example is not None:  # a string the run loop takes out before logging (TrainingGuard quotes it)
        out[ERROR_EXAMPLE] = f"sample {example.uid}: {example.metadata['reward_error']}"
    return out


def resolve_threads(cfg: RelaxConfig) -> None:
    """Fill ``rollout.num_threads`` / ``trainer.num_threads`` left null from the node's cores, so that the
    processes computing at the same moment hold no more torch threads than there are cores: OpenMP pools
    that outnumber the cores preempt each other's spinning threads (2 FSDP ranks x 2 threads on 2 cores:
    train phase 0.33 -> 0.22 s with 1 thread each). Colocate's phases take turns, so the rollout engines
    share the cores among themselves and so do the Actor's ranks; async runs them all at once."""
    cores = os.cpu_count() or 1
    engines, ranks = cfg.rollout.num_engines, actor_world_size(cfg.trainer)
    # processes computing while the engines generate / while the Actor's ranks train
    if cfg.mode.name == "colocate":
        generating, training = engines, ranks
    else:
        generating = training = engines + ranks
    if cfg.rollout.num_threads is None:
        cfg.rollout.num_threads = max(1, cores // generating)
    if cfg.trainer.num_threads is None:
        cfg.trainer.num_threads = max(1, cores // training)
