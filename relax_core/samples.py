"""The records that flow between roles: prompts in, samples out, padded tensor batches for training.

A :class:`Sample` is one response to one prompt. Its ``loss_mask`` covers the response tokens only (1 =
trained on, 0 = e.g. an environment observation in a multi-turn rollout) and ``multimodal_inputs`` holds
the processor tensors (pixel values, audio features) that travel with it to training. Samples of one
prompt share ``group_id``; group statistics (GRPO, RLOO) are taken over that id, never over positions.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from relax_models.routing_replay import not_recorded


class SampleStatus(enum.StrEnum):
    COMPLETED = "completed"  # stopped on an EOS/stop token
    TRUNCATED = "truncated"  # hit max_new_tokens / the context budget
    ABORTED = "aborted"  # cut short by a weight swap or scale-in; may be resumed
    FAILED = "failed"  # environment or reward failure; reward 0


@dataclass
class PromptRecord:
    """One dataset row, tokenized."""

    index: int
    prompt_ids: list[int]
    prompt_text: str
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    multimodal_inputs: dict[str, Any] | None = None
    # media items (paths, bytes) of a multimodal row by kind; ``multimodal_inputs`` is built from them when
    # the prompt is drawn (relax_core.data.multimodal), so a loaded dataset holds no pixel/audio tensors
    media: dict[str, list[Any]] | None = None
    # the prompt as chat messages (system prompt included): what an agent program starts from
    messages: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Sample:
    """One generated response with everything training needs to know about it."""

    group_id: int
    index_in_group: int
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    loss_mask: list[int]
    response_text: str = ""
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    multimodal_inputs: dict[str, Any] | None = None
    reward: float = 0.0
    reward_extras: dict[str, float] = field(default_factory=dict)
    status: SampleStatus = SampleStatus.COMPLETED
    policy_version: int = 0
    num_turns: int = 1
    # why generation ended: "eos"/"length" single-turn; multi-turn "done", "max_turns", "context", "env_error",
    # "env_timeout", "abort"
    stop_reason: str = ""
    # algorithm.routing_replay: the engine's MoE expert indices ``[tokens, layers, top_k]`` of the prompt and
    # the response tokens it fed (all but the last), relax_models.routing_replay; None: the trainer routes
    routing: torch.Tensor | None = None

    @property
    def uid(self) -> str:
        return f"{self.group_id}:{self.index_in_group}"


@dataclass
class RolloutRound:
    """What one rollout call wrote to the DataBus (mode=async), as the driver gets it back: the group
    slots it filled and the reward side of its rows. The rows themselves stay on the bus."""

    filled: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    reward_extras: list[dict[str, float]] = field(default_factory=list)
    # (position in ``rewards``, group id, index in group, message) of each reward that failed: the rewards
    # carry only their 0, the step's stop message quotes one
    reward_errors: list[tuple[int, int, int, str]] = field(default_factory=list)
    response_lengths: list[int] = field(default_factory=list)
    # every generated sample, kept or not (dynamic sampling's metrics)
    generated_groups: int = 0
    generated_rewards: list[float] = field(default_factory=list)
    kept_groups: int = 0
    put_s: float = 0.0
    # generations resumed after an abort at a weight swap
    resumed: int = 0

    def add_written(self, slots: list[int], samples: list[Sample], put_s: float) -> None:
        """Book ``samples``, just written into the group ``slots``."""
        self.filled += slots
        self.put_s += put_s
        self.reward_errors += [
            (len(self.rewards) + i, s.group_id, s.index_in_group, s.metadata["reward_error"])
            for i, s in enumerate(samples)
            if (s.metadata or {}).get("reward_error")
        ]
        self.rewards += [s.reward for s in samples]
        self.reward_extras += [s.reward_extras for s in samples]
        self.response_lengths += [len(s.response_ids) for s in samples]

    def reward_samples(self) -> list[Sample]:
        """The written samples' reward side (reward, extras, each error with its sample's id): what
        ``reward_metrics`` needs."""
        samples = [
            Sample(0, 0, [], [], [], [], reward=reward, reward_extras=extras)
            for reward, extras in zip(self.rewards, self.reward_extras, strict=True)
        ]
        for i, group_id, index, error in self.reward_errors:
            samples[i].group_id, samples[i].index_in_group = group_id, index
            samples[i].metadata = {"reward_error": error}
        return samples


@dataclass
class TrainBatch:
    """Right-padded tensors for a list of samples; row i is ``samples[i]``.

    ``input_ids`` is prompt+response; the per-token tensors (``loss_mask``, log-probs, advantages) are
    aligned to the *response* positions ``[:, :R]`` where R is the longest response: the logit that
    predicts response token j sits at position ``prompt_len + j - 1`` of ``input_ids``.
    """

    input_ids: torch.Tensor  # [B, L] long
    attention_mask: torch.Tensor  # [B, L] long
    prompt_lens: torch.Tensor  # [B] long
    response_lens: torch.Tensor  # [B] long
    loss_mask: torch.Tensor  # [B, R] float
    rollout_logprobs: torch.Tensor  # [B, R] float
    rewards: torch.Tensor  # [B] float
    group_ids: torch.Tensor  # [B] long
    policy_versions: torch.Tensor  # [B] long
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    multimodal_inputs: list[dict[str, Any] | None] = field(default_factory=list)
    # [B, L, layers, top_k] expert indices to replay (not-recorded value where a row has none); None: no replay
    routing: torch.Tensor | None = None

    @classmethod
    def from_samples(cls, samples: list[Sample], pad_token_id: int) -> TrainBatch:
        if not samples:
            raise ValueError("cannot build a TrainBatch from zero samples")
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        max_len, max_resp = max(lengths), max(max(len(s.response_ids) for s in samples), 1)
        n = len(samples)
        input_ids = torch.full((n, max_len), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((n, max_len), dtype=torch.long)
        loss_mask = torch.zeros((n, max_resp))
        rollout_logprobs = torch.zeros((n, max_resp))
        for i, s in enumerate(samples):
            ids = s.prompt_ids + s.response_ids
            input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[i, : len(ids)] = 1
            r = len(s.response_ids)
            if r:
                loss_mask[i, :r] = torch.tensor(s.loss_mask, dtype=torch.float)
                rollout_logprobs[i, :r] = torch.tensor(s.rollout_logprobs, dtype=torch.float)
        return cls(
            input_ids=input_ids,
            attention_mask=attention_mask,
            prompt_lens=torch.tensor([len(s.prompt_ids) for s in samples]),
            response_lens=torch.tensor([len(s.response_ids) for s in samples]),
            loss_mask=loss_mask,
            rollout_logprobs=rollout_logprobs,
            rewards=torch.tensor([s.reward for s in samples], dtype=torch.float),
            group_ids=torch.tensor([s.group_id for s in samples], dtype=torch.long),
            policy_versions=torch.tensor([s.policy_version for s in samples], dtype=torch.long),
            multimodal_inputs=[s.multimodal_inputs for s in samples],
            routing=_routing(samples, max_len),
        )

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, rows: torch.Tensor | list[int]) -> TrainBatch:
        """The sub-batch of ``rows`` (e.g. a micro-batch), trimmed to its own longest sequence."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        seq_len = int(self.attention_mask[rows].sum(-1).max())
        resp_len = max(int(self.response_lens[rows].max()), 1)
        return TrainBatch(
            input_ids=self.input_ids[rows, :seq_len],
            attention_mask=self.attention_mask[rows, :seq_len],
            prompt_lens=self.prompt_lens[rows],
            response_lens=self.response_lens[rows],
            loss_mask=self.loss_mask[rows, :resp_len],
            rollout_logprobs=self.rollout_logprobs[rows, :resp_len],
            rewards=self.rewards[rows],
            group_ids=self.group_ids[rows],
            policy_versions=self.policy_versions[rows],
            extras={k: v[rows, :resp_len] if v.dim() == 2 else v[rows] for k, v in self.extras.items()},
            multimodal_inputs=[self.multimodal_inputs[i] for i in rows.tolist()]
            if self.multimodal_inputs
            else [],
            routing=self.routing[rows, :seq_len] if self.routing is not None else None,
        )

    def micro_batches(self, size: int) -> list[TrainBatch]:
        return [self.select(list(range(i, min(i + size, len(self))))) for i in range(0, len(self), size)]


def _routing(samples: list[Sample], width: int) -> torch.Tensor | None:
    """``[B, width, layers, top_k]`` of the samples' recorded routing, padded with the not-recorded value
    (also the rows without any); None when no sample has routing."""
    recorded = [s.routing for s in samples if s.routing is not None]
    if not recorded:
        return None
    first = recorded[0]
    out = torch.full((len(samples), width, *first.shape[1:]), not_recorded(first.dtype), dtype=first.dtype)
    for i, s in enumerate(samples):
        if s.routing is not None:
            out[i, : s.routing.shape[0]] = s.routing
    return out
