"""The training-backend interface (torch/FSDP, Megatron-core) behind the Actor, ActorFwd, Reference and
Critic roles. A backend owns a model and its optimizer; the *math* (log-probs of the response tokens,
losses, aggregation) comes from :mod:`relax_core.algorithms` so every backend trains the same objective.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Iterator

import torch

from relax_core.samples import TrainBatch
from relax_models.weight_buckets import bucket_by_bytes

# (batch, token_logprobs [B, R], token_entropy [B, R]) -> (scalar loss, metrics)
LossFn = Callable[[TrainBatch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, float]]]
# micro-batch -> (token_logprobs [b, r], token_entropy [b, r]) under the current weights, with grad
LogprobFn = Callable[[TrainBatch], tuple[torch.Tensor, torch.Tensor]]


def accumulate_gradients(
    batch: TrainBatch,
    logprob_fn: LogprobFn,
    loss_fn: LossFn,
    micro_batch_size: int,
    grad_scale: float = 1.0,
    groups: list[list[int]] | None = None,
) -> dict[str, float]:
    """Backward of ``loss_fn`` over the micro-batches of ``batch``; the caller steps the optimizer.

    Micro-batches hold ``micro_batch_size`` rows, or the rows of each of ``groups`` (token-budget groups,
    :func:`token_budget_groups`; ``loss_fn`` weighs each micro-batch by its own share of the batch, so any
    grouping sums to one loss).

    Returns the metrics averaged over micro-batches, except ``loss``: the micro-batch losses are already
    scaled for accumulation, so their sum is the batch loss. ``grad_scale`` multiplies only the gradient:
    data-parallel ranks whose gradients are *averaged* pass their count, so the result is the gradient of
    the global batch's loss, as on one rank.
    """
    sums: dict[str, float] = {}
    if groups is None:  # also a bus stream's: it forms its own micro-batches
        micro_batches = batch.micro_batches(micro_batch_size)
    else:
        micro_batches = [batch.select(rows) for rows in groups]
    for micro in micro_batches:
        logprobs, entropy = logprob_fn(micro)
        loss, metrics = loss_fn(micro, logprobs, entropy)
        (loss * grad_scale if grad_scale != 1.0 else loss).backward()
        metrics["loss"] = float(loss.detach())
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v
    out = {k: v / len(micro_batches) for k, v in sums.items()}
    out["loss"] = sums["loss"]
    return out


# a step's count of optimizer updates skipped because their loss or gradient norm was not finite
SKIPPED_STEPS = "train/skipped_steps"


def update_is_finite(loss: float, grad_norm: float) -> bool:
    """Whether an optimizer update may be applied: a NaN/inf loss or gradient norm would spread NaN into
    every weight (the backends then zero the gradients and skip the step, counted in ``SKIPPED_STEPS``)."""
    return math.isfinite(loss) and math.isfinite(grad_norm)


def rank_slice(batch: TrainBatch, rank: int, ranks: int) -> TrainBatch:
    """Data-parallel rank ``rank``'s contiguous share of ``batch`` (the batch must divide evenly, so every
    rank runs the same number of micro-batches and the collectives inside them stay in step)."""
    if getattr(batch, "rank_local", False):  # a bus stream that reads only this rank's rows
        return batch
    if len(batch) % ranks:
        raise ValueError(f"a batch of {len(batch)} samples does not divide over {ranks} data-parallel ranks")
    size = len(batch) // ranks
    return batch.select(list(range(rank * size, (rank + 1) * size)))


def reduce_metrics(metrics: dict[str, float], device: torch.device, group=None) -> dict[str, float]:
    """Metrics of the global batch from every data-parallel rank's: ``loss`` summed (the ranks' losses
    are shares of one batch loss), everything else averaged. Collective over ``group``, whose backend
    serves ``device`` (the role's compute device: NCCL takes no CPU tensor)."""
    import torch.distributed as dist

    keys = sorted(metrics)
    values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(values, group=group)
    ranks = dist.get_world_size(group)
    return {k: float(v) if k == "loss" else float(v) / ranks for k, v in zip(keys, values.tolist())}


def max_over_ranks(value: int, device: torch.device, group=None) -> int:
    """The largest ``value`` over the ranks of ``group`` (collective; a tensor on ``device``, as above)."""
    import torch.distributed as dist

    widest = torch.tensor([value], device=device)
    dist.all_reduce(widest, op=dist.ReduceOp.MAX, group=group)
    return int(widest.item())


def batch_to_device(batch: TrainBatch, device: torch.device) -> TrainBatch:
    """``batch`` with its tensors on ``device`` (the same object on the CPU)."""
    if device.type == "cpu":
        return batch
    fields = {k: getattr(batch, k) for k in batch.__dataclass_fields__}
    for k, v in fields.items():
        if isinstance(v, torch.Tensor):
            fields[k] = v.to(device)
    fields["extras"] = {k: v.to(device) for k, v in batch.extras.items()}
    return TrainBatch(**fields)


def pad_to_width(parts: list[torch.Tensor], width: int) -> torch.Tensor:
    """Concatenate per-micro-batch ``[b, r_i]`` tensors, right-padded with zeros to ``[B, width]``."""
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])


def row_lengths(batch: TrainBatch) -> list[int]:
    """Prompt + response tokens of each row."""
    return batch.attention_mask.sum(-1).tolist()


def token_budget_groups(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Rows grouped so each group's tokens (its rows' ``lengths`` summed: packed, no padding) stay within
    ``max_tokens``: first fit, longest rows first; a row longer than the budget forms a group alone. Each
    group lists its rows in batch order."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    room: list[int] = []
    for i in order:
        fit = next((g for g, free in enumerate(room) if lengths[i] <= free), None)
        if fit is None:
            groups.append([i])
            room.append(max_tokens - lengths[i])
        else:
            groups[fit].append(i)
            room[fit] -= lengths[i]
    return [sorted(g) for g in groups]


def split_groups(groups: list[list[int]], count: int) -> list[list[int]]:
    """``groups`` with the largest split in halves until there are ``count`` of them (data-parallel ranks
    must run as many micro-batches: each forward and backward is collective). ``count`` must not exceed
    the rows."""
    groups = [list(g) for g in groups]
    if count > sum(len(g) for g in groups):
        raise ValueError(f"cannot split {sum(len(g) for g in groups)} rows into {count} micro-batches")
    while len(groups) < count:
        largest = max(groups, key=len)
        groups.remove(largest)
        half = len(largest) // 2
        groups += [largest[:half], largest[half:]]
    return groups


def scatter_rows(parts: list[torch.Tensor], groups: list[list[int]], width: int) -> torch.Tensor:
    """``[B, width]`` from per-group ``[b, r_i]`` tensors whose rows are the batch rows ``groups[i]``,
    zero-padded on the right."""
    out = parts[0].new_zeros(sum(len(g) for g in groups), width)
    for part, rows in zip(parts, groups):
        out[rows, : part.shape[1]] = part
    return out


def pack_rows(batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``batch``'s right-padded rows as one padding-free sequence for an HF causal LM: ``input_ids`` and
    ``position_ids`` ``[1, T]`` (positions restart at 0 on every row, from which HF builds a block-diagonal
    causal mask when no attention mask is given) and, flattened ``[B·R]``, the packed position of the logit
    that predicts each response token (``logits_to_keep``; steps past a row's response repeat its last)."""
    lengths = batch.attention_mask.sum(-1)
    starts = lengths.cumsum(0) - lengths
    input_ids = batch.input_ids[batch.attention_mask.bool()].unsqueeze(0)  # row-major: rows end to end
    position_ids = torch.arange(input_ids.shape[1], device=lengths.device) - starts.repeat_interleave(lengths)
    steps = torch.arange(batch.loss_mask.shape[1], device=lengths.device)
    last = (batch.response_lens - 1).clamp(min=0).unsqueeze(1)
    keep = starts.unsqueeze(1) + (batch.prompt_lens.unsqueeze(1) + torch.minimum(steps, last) - 1).clamp(
        min=0
    )
    return input_ids, position_ids.unsqueeze(0), keep.flatten()


class TrainingBackend(abc.ABC):
    @abc.abstractmethod
    def forward_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Log-probs ``[B, R]`` of the response tokens under the current weights (no grad)."""

    @abc.abstractmethod
    def train_step(self, batch: TrainBatch, loss_fn: LossFn, micro_batch_size: int) -> dict[str, float]:
        """One optimizer step over ``batch`` with gradient accumulation across micro-batches.

        ``loss_fn`` is called per micro-batch and must return a loss already scaled for accumulation.
        """

    def sum_over_ranks(self, values: list[float]) -> list[float]:
        """Element-wise sum of ``values`` over the data-parallel ranks (collective); one rank: ``values``."""
        return values

    def any_over_ranks(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank of the training world (collective)."""
        return bool(self.sum_over_ranks([float(flag)])[0])

    def data_parallel_rank(self, process_rank: int) -> int:
        """The data-parallel replica of the Actor process ``process_rank`` (each replica streams its own rows
        of a step in mode=async): the process itself, unless several processes hold one model replica."""
        return process_rank

    def scale_gradients(self, factor: float) -> None:
        """Multiply every accumulated gradient by ``factor`` (a streamed batch learns its loss denominator
        only after its last micro-batch)."""
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)

    def offload(self) -> None:
        """Free the accelerator for another phase (colocate: the rollout engines generate)."""

    def onload(self) -> None:
        """Undo :meth:`offload` before the next forward or optimizer step."""

    def nonfinite_weights(self) -> list[str]:
        """Names of this rank's parameters (its shards) holding NaN or inf."""
        bad = []
        for name, p in self.model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p  # an FSDP DTensor: this rank's shard
            if not bool(torch.isfinite(local.detach()).all()):
                bad.append(name)
        return bad

    def set_warm_start(self, active: bool) -> None:
        """Entering (``True``) or leaving the supervised warm-start, before the optimizer is reset for it
        (LoRA with ``full_warm_start``: the base model trains during it, the adapters after)."""

    @abc.abstractmethod
    def reset_optimizer(self, lr: float) -> None:
        """Fresh optimizer state at learning rate ``lr`` (between phases, e.g. warm-start -> RL)."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Policy weights in HF parameter names (what rollout engines load)."""

    def publish_weights(self) -> dict[str, torch.Tensor]:
        """What a published version of the policy carries (the weight transfer's payload): :meth:`state_dict`;
        LoRA with adapter sync: an adapter payload (``relax_models.lora.adapter_payload``)."""
        return self.state_dict()

    def iter_weights(self, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        """Full (gathered) weights in HF names, in buckets of at most ``bucket_bytes`` (a larger tensor
        travels alone). Collective for sharded backends: every rank iterates in step. This default slices
        :meth:`state_dict`; sharded backends gather bucket by bucket instead of holding a full copy."""
        for bucket in bucket_by_bytes(self.state_dict().items(), bucket_bytes):
            yield dict(bucket)

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
