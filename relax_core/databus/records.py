"""Samples <-> bus rows: the fields Rollout writes and the TrainBatch a consumer rebuilds from them."""

from __future__ import annotations

import io
from typing import Any

import torch

from relax_core.databus.base import DataBus, Fields, sample_key
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
# a sample's multimodal inputs (processor tensors), serialised: the n samples of a prompt share one dict, so
# only the first row of a write that carries it holds the bytes ("media") and every row names the position
# of that row ("media_from", -1: no media); a consumer that runs the model reads both (:func:`get_rows`)
MEDIA_FIELDS = ["media", "media_from"]
# a sample's recorded MoE routing (algorithm.routing_replay: ``Sample.routing``, empty when none), which the
# Actor's forwards replay
ROUTING_FIELD = "routing"
# what a role that runs the model on the rows reads besides SAMPLE_FIELDS
FORWARD_FIELDS = [*MEDIA_FIELDS, ROUTING_FIELD]


def encode_media(inputs: dict[str, Any]) -> torch.Tensor:
    """One sample's multimodal inputs as a 1-d uint8 tensor (the bus carries tensors only)."""
    buffer = io.BytesIO()
    torch.save(inputs, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def decode_media(blob: torch.Tensor) -> dict[str, Any]:
    return torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)


def media_columns(samples: list[Sample], keys: list[str]) -> Fields:
    """``media`` / ``media_from`` of rows ``keys``: a dict shared by several rows is written once."""
    holder: dict[int, int] = {}  # id of a dict -> position of the row holding its bytes
    media, source = [], []
    for sample, key in zip(samples, keys, strict=True):
        inputs = sample.multimodal_inputs
        if not inputs:
            media.append(torch.empty(0, dtype=torch.uint8))
            source.append(torch.tensor(-1))
        elif id(inputs) in holder:
            media.append(torch.empty(0, dtype=torch.uint8))
            source.append(torch.tensor(holder[id(inputs)]))
        else:
            holder[id(inputs)] = int(key)
            media.append(encode_media(inputs))
            source.append(torch.tensor(int(key)))
    return {"media": media, "media_from": source}


def get_rows(bus: DataBus, partition: str, keys: list[str], fields: list[str]) -> Fields:
    """:meth:`DataBus.get`, where each row's ``media`` is the bytes of its own multimodal inputs (fetched
    from the row that holds them when that row is not among ``keys``)."""
    rows = bus.get(partition, keys, fields)
    if "media" not in fields:
        return rows
    sources = [int(v) for v in rows["media_from"]]
    held = {int(k): rows["media"][i] for i, k in enumerate(keys) if sources[i] == int(k)}
    missing = sorted({src for src in sources if src >= 0 and src not in held})
    if missing:
        fetched = bus.get(partition, [sample_key(p) for p in missing], ["media"])["media"]
        held |= dict(zip(missing, fetched, strict=True))
    rows["media"] = [
        held[src] if src >= 0 else blob for src, blob in zip(sources, rows["media"], strict=True)
    ]
    return rows


def sample_rows(
    samples: list[Sample], first_position: int, keys: list[str] | None = None
) -> tuple[list[str], Fields]:
    """Keys and columns of ``samples``, the first at step position ``first_position`` (or at ``keys``)."""
    keys = keys or [sample_key(first_position + i) for i in range(len(samples))]
    fields: Fields = {
        "prompt_ids": [torch.tensor(s.prompt_ids, dtype=torch.long) for s in samples],
        "response_ids": [torch.tensor(s.response_ids, dtype=torch.long) for s in samples],
        "rollout_logprobs": [torch.tensor(s.rollout_logprobs, dtype=torch.float) for s in samples],
        "loss_mask": [torch.tensor(s.loss_mask, dtype=torch.float) for s in samples],
        "reward": [torch.tensor(float(s.reward)) for s in samples],
        "group_id": [torch.tensor(s.group_id, dtype=torch.long) for s in samples],
        "policy_version": [torch.tensor(s.policy_version, dtype=torch.long) for s in samples],
    }
    fields[ROUTING_FIELD] = [encode_routing(s.routing) for s in samples]
    return keys, fields | media_columns(samples, keys)


def batch_from_rows(rows: Fields, pad_token_id: int, extras: list[str] = ()) -> TrainBatch:
    """A right-padded TrainBatch of bus rows; ``extras`` are per-token fields aligned to the response.
    Rows read with :data:`FORWARD_FIELDS` (:func:`get_rows`) get their multimodal inputs, one dict per holder
    row shared by the rows that name it, as colocate's samples share their prompt's, and their routing."""
    n = len(rows["prompt_ids"])
    media: list[dict[str, Any] | None] = [None] * n
    if "media" in rows:
        decoded: dict[int, dict[str, Any]] = {}
        for i, src in enumerate(int(v) for v in rows["media_from"]):
            if src >= 0 and src not in decoded:
                decoded[src] = decode_media(rows["media"][i])
            media[i] = decoded.get(src)
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
            multimodal_inputs=media[i],
            routing=_routing(rows, i),
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


def encode_routing(routing: torch.Tensor | None) -> torch.Tensor:
    """A sample's ``[tokens, layers, top_k]`` routing as one 1-d tensor of its dtype (the buses carry rows
    flat): ``[layers, top_k]`` then the indices; empty for none."""
    if routing is None:
        return torch.empty(0, dtype=torch.uint8)
    if max(routing.shape[1:]) > torch.iinfo(routing.dtype).max:
        raise ValueError(f"routing of shape {tuple(routing.shape)} does not fit a {routing.dtype} header")
    return torch.cat([torch.tensor(routing.shape[1:], dtype=routing.dtype), routing.reshape(-1)])


def decode_routing(blob: torch.Tensor) -> torch.Tensor | None:
    if not blob.numel():
        return None
    layers, top_k = (int(v) for v in blob[:2])
    return blob[2:].reshape(-1, layers, top_k)


def _routing(rows: Fields, i: int) -> torch.Tensor | None:
    return decode_routing(rows[ROUTING_FIELD][i]) if ROUTING_FIELD in rows else None


def per_sample(values: torch.Tensor, batch: TrainBatch) -> list[torch.Tensor]:
    """Split a ``[B, R]`` per-token tensor into one response-length tensor per row (for the bus)."""
    return [values[i, : int(batch.response_lens[i])].detach().clone() for i in range(len(batch))]
