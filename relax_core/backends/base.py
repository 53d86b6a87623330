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
# micro-batch -> (token_logprobs [b, r], token_entropy [b, r]) under the current weights, with grad
LogprobFn = Callable[[TrainBatch], tuple[torch.Tensor, torch.Tensor]]


def accumulate_gradients(
    batch: TrainBatch, logprob_fn: LogprobFn, loss_fn: LossFn, micro_batch_size: int
) -> dict[str, float]:
    """Backward of ``loss_fn`` over the micro-batches of ``batch``; the caller steps the optimizer.

    Returns the metrics averaged over micro-batches, except ``loss``: the micro-batch losses are already
    scaled for accumulation, so their sum is the batch loss.
    """
    sums: dict[str, float] = {}
    micro_batches = batch.micro_batches(micro_batch_size)
    for micro in micro_batches:
        logprobs, entropy = logprob_fn(micro)
        loss, metrics = loss_fn(micro, logprobs, entropy)
        loss.backward()
        metrics["loss"] = float(loss.detach())
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v
    out = {k: v / len(micro_batches) for k, v in sums.items()}
    out["loss"] = sums["loss"]
    return out


def pad_to_width(parts: list[torch.Tensor], width: int) -> torch.Tensor:
    """Concatenate per-micro-batch ``[b, r_i]`` tensors, right-padded with zeros to ``[B, width]``."""
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])


class TrainingBackend(abc.ABC):
    @abc.abstractmethod
    def forward_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Log-probs ``[B, R]`` of the response tokens under the current weights (no grad)."""

    @abc.abstractmethod
    def train_step(self, batch: TrainBatch, loss_fn: LossFn, micro_batch_size: int) -> dict[str, float]:
        """One optimizer step over ``batch`` with gradient accumulation across micro-batches.

        ``loss_fn`` is called per micro-batch and must return a loss already scaled for accumulation.
        """

    def scale_gradients(self, factor: float) -> None:
        """Multiply every accumulated gradient by ``factor`` (a streamed batch learns its loss denominator
        only after its last micro-batch)."""
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)

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
