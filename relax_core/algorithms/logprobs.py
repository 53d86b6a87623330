"""Response-token log-probs and entropy from model logits — the one place every backend gets them."""

from __future__ import annotations

import torch

from relax_core.samples import TrainBatch


def response_positions(batch: TrainBatch) -> torch.Tensor:
    """Index ``[B, R]`` of the logit that predicts each response token: prompt_len + j − 1."""
    steps = torch.arange(batch.loss_mask.shape[1], device=batch.prompt_lens.device)
    last = batch.input_ids.shape[1] - 2
    return (batch.prompt_lens.unsqueeze(1) + steps - 1).clamp(0, max(last, 0))


def response_tokens(batch: TrainBatch) -> torch.Tensor:
    """The response token ids ``[B, R]`` (pad beyond each row's response; the loss mask hides them)."""
    return batch.input_ids.gather(1, (response_positions(batch) + 1).clamp(max=batch.input_ids.shape[1] - 1))


def token_logprobs_and_entropy(
    logits: torch.Tensor, batch: TrainBatch, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(y_j | x, y_<j) and the entropy H_j of each response step ``[B, R]`` from the model's logits
    ``[B, L, V]`` over ``batch.input_ids``: only the R response positions are normalised (not all L), which
    keeps memory at B·R·V."""
    pos = response_positions(batch)
    picked = logits.gather(1, pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    return response_logprobs_and_entropy(picked, batch, temperature)


def response_logprobs_and_entropy(
    response_logits: torch.Tensor, batch: TrainBatch, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(y_j | x, y_<j) and the entropy H_j = −Σ_v p_v log p_v from ``[B, R, V]`` logits whose column j
    predicts response token j.

    The logits are divided by the rollout temperature so training scores tokens under the distribution they
    were sampled from.
    """
    picked = response_logits.float()
    if temperature > 0 and temperature != 1.0:
        picked = picked / temperature
    logp_all = torch.log_softmax(picked, dim=-1)
    logprobs = logp_all.gather(-1, response_tokens(batch).unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logprobs * batch.loss_mask, entropy * batch.loss_mask
