"""The training-backend interface (torch/FSDP, Megatron-core) behind the Actor, ActorFwd, Reference and
Critic roles. A backend owns a model and its optimizer; the *math* (log-probs of the response tokens,
losses, aggregation) comes from :mod:`relax_core.algorithms` so every backend trains the same objective.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import torch

from relax_core.samples import TrainBatch

# (batch, token_logprobs [B, R], token_entropy [B, R]) -> (scalar loss, metrics)
LossFn = Callable[[TrainBatch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, float]]]


class TrainingBackend(abc.ABC):
    @abc.abstractmethod
    def forward_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Log-probs ``[B, R]`` of the response tokens under the current weights (no grad)."""

    @abc.abstractmethod
    def train_step(self, batch: TrainBatch, loss_fn: LossFn, micro_batch_size: int) -> dict[str, float]:
        """One optimizer step over ``batch`` with gradient accumulation across micro-batches.

        ``loss_fn`` is called per micro-batch and must return a loss already scaled for accumulation.
        """

    @abc.abstractmethod
    def reset_optimizer(self, lr: float) -> None:
        """Fresh optimizer state at learning rate ``lr`` (between phases, e.g. warm-start -> RL)."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Policy weights in HF parameter names (what rollout engines load)."""

    @abc.abstractmethod
    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Replace the weights (HF parameter names)."""

    @abc.abstractmethod
    def save_checkpoint(self, path: str) -> None:
        """Model, optimizer, scheduler and RNG state under directory ``path``."""

    @abc.abstractmethod
    def load_checkpoint(self, path: str) -> None:
        """Inverse of :meth:`save_checkpoint`."""

    @abc.abstractmethod
    def export_hf(self, path: str) -> None:
        """Write an HF folder (config, safetensors, tokenizer) that transformers loads."""
