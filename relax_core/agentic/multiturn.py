"""Multi-turn episodes: the model and one environment per sample take turns until the episode ends.

Token layout of a sample (all after the dataset prompt, in ``Sample.response_ids``)::

    [reset observation]  turn 1 tokens  observation 1  turn 2 tokens  observation 2 ...  turn k tokens
     mask 0               mask 1         mask 0         mask 1         mask 0              mask 1

Model tokens keep the log-probs they were sampled with; observation tokens have log-prob 0 and loss mask
0, so training (policy loss, KL, entropy, aggregation: all weighted by ``loss_mask``) ignores them while
the model still attends to them. An episode ends when the environment says done (``stop_reason="done"``),
after ``rollout.max_turns`` model turns (``"max_turns"``), when the context reaches
``rollout.max_context_len`` tokens (``"context"``), or when the environment raises or exceeds
``rollout.env_step_timeout_s`` (``"env_error"`` / ``"env_timeout"``: status FAILED, reward 0, loss mask
zeroed unless ``rollout.failed_sample_policy=keep``). All live episodes of a step generate together, one
engine call per turn.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from relax_core.agentic.env import (
    BaseInteractionEnv,
    EnvFailure,
    call_many_with_timeout,
    env_kwargs,
    resolve_env_class,
)
from relax_core.agentic.formatting import ObservationFormatter, merge_multimodal
from relax_core.engines.base import GenerationRequest, RolloutEngine, SamplingParams
from relax_core.samples import PromptRecord, Sample, SampleStatus

if TYPE_CHECKING:
    from relax_core.config.schema import RolloutConfig

log = logging.getLogger("relax")


@dataclass
class Episode:
    """The growing state of one sample's episode."""

    prompt: PromptRecord
    index_in_group: int
    env: BaseInteractionEnv | None = None
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    multimodal: dict[str, Any] | None = None
    turns: int = 0
    reward: float = 0.0
    has_reward: bool = False
    last_info: dict[str, Any] = field(default_factory=dict)
    stop_reason: str = ""
    status: SampleStatus = SampleStatus.COMPLETED
    error: str = ""
    version: int = 0
    ended_with_eos: bool = True

    @property
    def context(self) -> list[int]:
        return self.prompt.prompt_ids + self.response_ids

    @property
    def live(self) -> bool:
        return not self.stop_reason

    def add(self, ids: list[int], logprobs: list[float] | None, trained: bool) -> None:
        self.response_ids += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.loss_mask += [1 if trained else 0] * len(ids)

    def end(self, reason: str, status: SampleStatus, error: str = "") -> None:
        self.stop_reason, self.status, self.error = reason, status, error


# one turn for each live episode: (token ids, log-probs, finish_reason, weight version)
TurnPolicy = Callable[[list[Episode], int], list[tuple[list[int], list[float], str, int]]]


def engine_policy(engine: RolloutEngine, sampling: SamplingParams) -> TurnPolicy:
    """Turns sampled by a rollout engine; episodes with the same token budget share one call."""

    def policy(episodes: list[Episode], budget_cap: int) -> list[tuple[list[int], list[float], str, int]]:
        out: list[Any] = [None] * len(episodes)
        by_budget: dict[int, list[int]] = {}
        for i, ep in enumerate(episodes):
            by_budget.setdefault(min(sampling.max_new_tokens, budget_cap - len(ep.context)), []).append(i)
        for budget, rows in by_budget.items():
            params = dataclasses.replace(sampling, n=1, max_new_tokens=budget)
            requests = [
                GenerationRequest(
                    episodes[i].context, f"{episodes[i].prompt.index}:{i}", episodes[i].multimodal
                )
                for i in rows
            ]
            for i, res in zip(rows, engine.generate(requests, params), strict=True):
                out[i] = (res.output_ids, res.logprobs, res.finish_reason, res.weight_version)
        return out

    return policy


class MultiTurnRunner:
    """Runs episodes for a batch of prompts with ``rollout.env``; returns one :class:`Sample` per episode."""

    def __init__(
        self, rollout_cfg: RolloutConfig, tokenizer, model_path: str | None = None, seed: int = 0
    ) -> None:
        self.cfg = rollout_cfg
        self.env_cls = resolve_env_class(dict(rollout_cfg.env))
        self.env_kwargs = env_kwargs(dict(rollout_cfg.env))
        self.tokenizer = tokenizer
        self.formatter = ObservationFormatter(tokenizer, model_path)
        self.seed = seed
        self._episodes_started = 0
        self.eos_id = tokenizer.eos_token_id

    # ------------------------------------------------------------------ lifecycle of a batch
    def run(
        self,
        prompts: list[PromptRecord],
        n: int,
        policy: TurnPolicy,
        score: Callable[[list[Sample]], None] | None = None,
    ) -> list[Sample]:
        """``n`` episodes per prompt, request-major like single-turn generation."""
        episodes = [Episode(p, k, multimodal=p.multimodal_inputs) for p in prompts for k in range(n)]
        try:
            self._start(episodes)
            while True:
                live = [ep for ep in episodes if ep.live]
                if not live:
                    break
                self._turn(live, policy)
        finally:
            self._close(episodes)
        samples = [self._to_sample(ep) for ep in episodes]
        # episodes whose environment gave no reward are scored by the run's reward function
        unscored = [
            s for s, ep in zip(samples, episodes) if not ep.has_reward and s.status != SampleStatus.FAILED
        ]
        if score is not None and unscored:
            extras = [dict(s.reward_extras) for s in unscored]
            score(unscored)
            for s, ex in zip(unscored, extras):
                s.reward_extras = ex | s.reward_extras
        return samples

    def _start(self, episodes: list[Episode]) -> None:
        """Build one environment per episode and append the reset observations (loss-masked)."""
        for ep in episodes:
            seed = self.seed * 1_000_003 + self._episodes_started
            self._episodes_started += 1
            try:
                ep.env = self.env_cls(
                    label=ep.prompt.label, metadata=dict(ep.prompt.metadata), seed=seed, **self.env_kwargs
                )
            except Exception as err:  # noqa: BLE001  (user code)
                ep.end("env_error", SampleStatus.FAILED, f"constructor: {type(err).__name__}: {err}")
        live = [ep for ep in episodes if ep.live]
        results = call_many_with_timeout([(ep.env.reset, ()) for ep in live], self.cfg.env_step_timeout_s)
        for ep, result in zip(live, results):
            if isinstance(result, EnvFailure):
                ep.end(result.kind, SampleStatus.FAILED, f"reset: {result}")
                continue
            observation, _info = result
            if observation is not None:
                self._observe(ep, observation)

    def _turn(self, live: list[Episode], policy: TurnPolicy) -> None:
        cap = self.cfg.max_context_len
        ready = []
        for ep in live:
            if len(ep.context) >= cap:
                ep.end("context", SampleStatus.TRUNCATED)
            else:
                ready.append(ep)
        if not ready:
            return
        outputs = policy(ready, cap)
        stepping = []
        for ep, (ids, logprobs, finish, version) in zip(ready, outputs, strict=True):
            ep.add(list(ids), list(logprobs), trained=True)
            ep.turns += 1
            ep.version = version
            ep.ended_with_eos = bool(ids) and ids[-1] == self.eos_id
            if finish == "abort":
                ep.end("abort", SampleStatus.ABORTED)
                continue
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            stepping.append((ep, text))
        results = call_many_with_timeout(
            [(ep.env.step, (text,)) for ep, text in stepping], self.cfg.env_step_timeout_s
        )
        for (ep, _), result in zip(stepping, results):
            if isinstance(result, EnvFailure):
                ep.end(result.kind, SampleStatus.FAILED, f"step: {result}")
                continue
            try:
                observation, done, info = result
                info = dict(info or {})
            except (TypeError, ValueError):
                ep.end("env_error", SampleStatus.FAILED, "step() must return (observation, done, info)")
                continue
            if "reward" in info:
                ep.reward += float(info["reward"])
                ep.has_reward = True
            ep.last_info = info
            if done:
                ep.end("done", SampleStatus.COMPLETED)
            elif ep.turns >= self.cfg.max_turns:
                ep.end("max_turns", SampleStatus.TRUNCATED)
            elif observation is not None:
                self._observe(ep, observation)

    def _observe(self, ep: Episode, observation: Any) -> None:
        """Append an observation (mask 0); past the context budget the episode ends instead."""
        try:
            message = ep.env.format_observation(observation)
            ids, media = self.formatter.encode(message, ep.ended_with_eos)
        except Exception as err:  # noqa: BLE001  (user code formats the observation)
            ep.end("env_error", SampleStatus.FAILED, f"format_observation: {type(err).__name__}: {err}")
            return
        if len(ep.context) + len(ids) >= self.cfg.max_context_len:
            ep.end("context", SampleStatus.TRUNCATED)
            return
        ep.add(ids, None, trained=False)
        ep.multimodal = merge_multimodal(ep.multimodal, media)

    def _close(self, episodes: list[Episode]) -> None:
        envs = [ep.env for ep in episodes if ep.env is not None]
        for result in call_many_with_timeout([(env.close, ()) for env in envs], self.cfg.env_step_timeout_s):
            if isinstance(result, EnvFailure):
                log.warning("environment close() failed: %s", result)

    # ------------------------------------------------------------------ records
    def _to_sample(self, ep: Episode) -> Sample:
        failed = ep.status == SampleStatus.FAILED
        mask = ep.loss_mask
        if failed and self.cfg.failed_sample_policy == "mask":
            mask = [0] * len(mask)
        extras = {
            k: float(v) for k, v in ep.last_info.items() if k != "reward" and isinstance(v, int | float)
        }
        extras |= {"turns": float(ep.turns), "env_failed": float(failed)}
        if failed:
            log.warning("episode %s:%d failed: %s", ep.prompt.index, ep.index_in_group, ep.error)
        return Sample(
            group_id=ep.prompt.index,
            index_in_group=ep.index_in_group,
            prompt_ids=ep.prompt.prompt_ids,
            response_ids=ep.response_ids,
            rollout_logprobs=ep.logprobs,
            loss_mask=mask,
            response_text=self.tokenizer.decode(ep.response_ids, skip_special_tokens=True),
            label=ep.prompt.label,
            metadata=ep.prompt.metadata | ({"env_error": ep.error} if ep.error else {}),
            multimodal_inputs=ep.multimodal,
            reward=0.0 if failed else ep.reward,
            reward_extras=extras,
            status=ep.status,
            policy_version=ep.version,
            num_turns=ep.turns,
            stop_reason=ep.stop_reason,
        )

    def generate(
        self,
        engine: RolloutEngine,
        prompts: list[PromptRecord],
        sampling: SamplingParams,
        score: Callable[[list[Sample]], None] | None = None,
    ) -> list[Sample]:
        """``sampling.n`` engine-sampled episodes per prompt (what the Rollout role calls)."""
        return self.run(prompts, sampling.n, engine_policy(engine, sampling), score)
