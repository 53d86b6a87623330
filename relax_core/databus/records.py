"""Samples <-> bus rows: the fields Rollout writes and the TrainBatch a consumer rebuilds from them."""

from __future__ import annotations

import torch

from relax_core.databus.base import Fields, sample_key
from relax_core.samples import Sample, TrainBatch

# what Rollout writes for every sample
SAMPLE_FIELDS = [
    "prompt_ids",
    "response_ids",
    "rollout_logprobs",
    "loss_mask",
    "reward",
    "group_id",
    "policy_version",
]


def sample_rows(samples: list[Sample], first_position: int) -> tuple[list[str], Fields]:
    """Keys and columns of ``samples``, the first at step position ``first_position``."""
    keys = [sample_key(first_position + i) for i in range(len(samples))]
    fields: Fields = {
        "prompt_ids": [torch.tensor(s.prompt_ids, dtype=torch.long) for s in samples],
        "response_ids": [torch.tensor(s.response_ids, dtype=torch.long) for s in samples],
        "rollout_logprobs": [torch.tensor(s.rollout_logprobs, dtype=torch.float) for s in samples],
        "loss_mask": [torch.tensor(s.loss_mask, dtype=torch.float) for s in samples],
        "reward": [torch.tensor(float(s.reward)) for s in samples],
        "group_id": [torch.tensor(s.group_id, dtype=torch.long) for s in samples],
        "policy_version": [torch.tensor(s.policy_version, dtype=torch.long) for s in samples],
    }
    return keys, fields


def batch_from_rows(rows: Fields, pad_token_id: int, extras: list[str] = ()) -> TrainBatch:
    """A right-padded TrainBatch of bus rows; ``extras`` are per-token fields aligned to the response."""
    n = len(rows["prompt_ids"])
    samples = [
        Sample(
            group_id=int(rows["group_id"][i]),
            index_in_group=i,
            prompt_ids=rows["prompt_ids"][i].tolist(),
            response_ids=rows["response_ids"][i].tolist(),
            rollout_logprobs=rows["rollout_logprobs"][i].tolist(),
            loss_mask=rows["loss_mask"][i].tolist(),
            reward=float(rows["reward"][i]),
            policy_version=int(rows["policy_version"][i]),
        )
        for i in range(n)
    ]
    batch = TrainBatch.from_samples(samples, pad_token_id)
    width = batch.loss_mask.shape[1]
    for name in extras:
        col = torch.zeros((n, width))
        for i, v in enumerate(rows[name]):
            col[i, : v.numel()] = v.float()
        batch.extras[name] = col
    return batch


def per_sample(values: torch.Tensor, batch: TrainBatch) -> list[torch.Tensor]:
    """Split a ``[B, R]`` per-token tensor into one response-length tensor per row (for the bus)."""
    return [values[i, : int(batch.response_lens[i])].detach().clone() for i in range(len(batch))]
