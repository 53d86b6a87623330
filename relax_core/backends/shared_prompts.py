"""Scoring a batch whose rows share prompts — GRPO's groups — with each distinct prompt run once.

A group of n samples repeats one prompt n times. Instead of n forwards over prompt + response, the prompt
runs once; its per-layer keys and values (the KV cache, with their autograd graph) are copied out to the n
rows, and only the response tokens run per row, attending to that cache. The logits are the same function
of the weights as the plain forward (equal up to float rounding), and so are the gradients: they flow into
the prompt pass through the cache. On the default task (10-token prompts, 8-token responses, 8 samples per
prompt) this halves the tokens a step trains on.
"""

from __future__ import annotations

import torch

from relax_core.algorithms.logprobs import response_tokens
from relax_core.samples import TrainBatch
from relax_models.loader import KV_CACHE_KEY


def distinct_prompts(batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct prompts, left-padded with -1, ``[G, P]``, and each row's prompt index ``[B]``."""
    width = int(batch.prompt_lens.max())
    cols = torch.arange(width, device=batch.input_ids.device)
    prompts = batch.input_ids[:, :width].masked_fill(cols >= batch.prompt_lens.unsqueeze(1), -1)
    unique, inverse = torch.unique(prompts, dim=0, return_inverse=True)
    lengths = (unique >= 0).sum(1, keepdim=True)
    # right-padded -> left-padded, so every prompt ends at the last column and the responses follow it
    shift = (cols.unsqueeze(0) - (width - lengths)) % width
    return unique.gather(1, shift).masked_fill(cols < width - lengths, -1), inverse


def prompt_groups(batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`distinct_prompts` when sharing them pays (at least two rows per distinct prompt on average,
    text only), else None."""
    if any(mm is not None for mm in batch.multimodal_inputs):
        return None
    groups = distinct_prompts(batch)
    return groups if 2 * len(groups[0]) <= len(batch) else None


def shared_prompt_logits(
    model: torch.nn.Module, batch: TrainBatch, groups: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """``[B, R, V]`` logits of an HF causal LM whose column j predicts response token j, with each distinct
    prompt of ``batch`` (``groups``: :func:`prompt_groups`) run through ``model`` once."""
    prompts, inverse = groups
    prompt_mask = (prompts >= 0).long()
    prompt_positions = (prompt_mask.cumsum(1) - 1).clamp(min=0)
    first = model(
        input_ids=prompts.clamp(min=0),  # any id under a zero mask
        attention_mask=prompt_mask,
        position_ids=prompt_positions,
        use_cache=True,
        logits_to_keep=1,
    )
    head = first.logits.index_select(0, inverse)  # predicts response token 0 from the prompt's last position
    width = batch.loss_mask.shape[1]
    if width == 1:
        return head
    # response tokens 0..R-2 predict tokens 1..R-1; each row attends to its prompt's keys and values
    cache = getattr(first, KV_CACHE_KEY)
    for layer in cache.layers:
        # index_select, not the cache's own batch_select_indices (``keys[indices]``): on CPU the backward of
        # advanced indexing sums repeated rows in a thread-dependent order, so runs of one seed drifted apart
        layer.keys, layer.values = layer.keys.index_select(0, inverse), layer.values.index_select(0, inverse)
    tokens = response_tokens(batch)[:, :-1]
    steps = torch.arange(width - 1, device=tokens.device)
    token_mask = (steps < batch.response_lens.unsqueeze(1)).long()
    rest = model(
        input_ids=tokens,
        attention_mask=torch.cat([prompt_mask[inverse], token_mask], 1),
        position_ids=batch.prompt_lens.unsqueeze(1) + steps,
        use_cache=True,
        **{KV_CACHE_KEY: cache},
    )
    return torch.cat([head, rest.logits], 1)
