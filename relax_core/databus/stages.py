"""How a role works through one step's rows on the DataBus (mode=async): wait for rows with the fields
it needs, compute, write its field, mark the rows consumed. Every role uses these; none has a bus copy of
itself. :class:`BusProducer` is the writing side: a step's scored prompt groups (the rollout engines', or
an agent program's episodes)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from relax_core.algorithms.objective import micro_batch_weight, sequence_count
from relax_core.algorithms.sampling_rules import shape_rewards, with_spread
from relax_core.databus.base import DataBus, Fields, PartitionCancelled, partition_name, sample_key
from relax_core.databus.records import (
    FORWARD_FIELDS,
    SAMPLE_FIELDS,
    batch_from_rows,
    get_rows,
    per_sample,
    sample_rows,
)
from relax_core.runtime.ray_errors import RayActorError
from relax_core.samples import RolloutRound, Sample, TrainBatch


def prompt_groups(samples: list[Sample], group_size: int) -> list[list[Sample]]:
    """Consecutive prompt groups of a rollout's samples (the n samples of a prompt are adjacent)."""
    return [samples[i : i + group_size] for i in range(0, len(samples), group_size)]


def complete_groups(keys: list[str], group_size: int) -> list[str]:
    """The keys whose whole prompt group is among ``keys`` (key = prompt position · n + sample index)."""
    count: dict[int, int] = {}
    for k in keys:
        count[int(k) // group_size] = count.get(int(k) // group_size, 0) + 1
    return [k for k in keys if count[int(k) // group_size] == group_size]


def stream_stage(
    bus: DataBus,
    step: int,
    total: int,
    need: list[str],
    task: str,
    chunk: int,
    fn: Callable[[list[str], Fields], Fields],
    whole_step: bool = False,
    group_size: int = 0,
    sharded: bool = False,
) -> float:
    """Process every row of step ``step`` once: wait for rows with ``need``, ``fn(keys, rows)`` -> new
    fields, write them, mark the rows consumed by ``task``. ``group_size``: only whole prompt groups.
    Returns the seconds spent waiting.

    ``sharded``: this process is one rank of an FSDP group whose ``fn`` is collective. Rank 0 picks the
    rows and tells the others (or that the step was cancelled, so that no rank is left waiting in a
    collective); every rank runs ``fn`` on them; rank 0 writes the result."""
    part, done, waited = partition_name(step), 0, 0.0
    leader = not sharded or dist.get_rank() == 0
    while done < total:
        t = time.perf_counter()
        keys: list[str] | None = None
        if leader:
            try:
                keys = bus.wait_ready(part, need, task, min_count=(total - done) if whole_step else 1)
                keys = keys if whole_step else keys[:chunk]
                keys = complete_groups(keys, group_size) if group_size else keys
            except PartitionCancelled:
                if not sharded:
                    raise
        if sharded:
            box = [keys]
            dist.broadcast_object_list(box, src=0)
            if (keys := box[0]) is None:
                raise PartitionCancelled(part)
        if not keys:  # a group is still being written
            time.sleep(0.005)
            continue
        waited += time.perf_counter() - t
        fields = fn(keys, get_rows(bus, part, keys, need))
        if leader:
            bus.put(part, keys, fields)
            bus.consume(part, keys, task)
        done += len(keys)
    if sharded:  # every rank may read what rank 0 wrote once this returns
        dist.barrier()
    return waited


def score_stage(
    bus: DataBus,
    pad_token_id: int,
    step: int,
    total: int,
    task: str,
    field: str,
    chunk: int,
    score: Callable[[TrainBatch], torch.Tensor],
) -> dict[str, float]:
    """Stream step ``step``'s rows through ``score(batch) -> [B, R]`` into the per-token ``field``; a role
    whose model is FSDP-sharded over several processes scores collectively (:func:`stream_stage`)."""

    def fn(keys: list[str], rows: Fields) -> Fields:
        batch = batch_from_rows(rows, pad_token_id)
        return {field: per_sample(score(batch), batch)}

    sharded = dist.is_initialized() and dist.get_world_size() > 1
    need = SAMPLE_FIELDS + FORWARD_FIELDS  # the model sees each row's media and routing
    waited = stream_stage(bus, step, total, need, task, chunk, fn, sharded=sharded)
    return {f"time/{task}_wait_s": waited}


@dataclass
class BusStep:
    """A step's rows on the DataBus, as the Actor trains on them in mode=async (``Actor.train``): ``total``
    rows, each read once it has the fields ``need``; ``extras`` are the per-token fields that go into the
    batch's extras (old log-probs, advantages, ...)."""

    total: int
    need: list[str]
    extras: list[str]


class MicroStream:
    """Stands in for a TrainBatch in ``backend.train_step``: yields micro-batches of one optimizer batch
    as soon as their rows have every field, and fixes the loss scale once the last one has gone through.

    Each micro-batch's loss carries the un-normalised weight (its tokens for token-mean, its sequences
    otherwise) because the batch total is unknown while it streams; after the last backward the gradients
    are divided by that total (``backend.scale_gradients``), which gives exactly the whole-batch gradient
    Σ_i (w_i / W) ∇ℓ_i.

    Data-parallel ranks each stream their own ``keys`` (``rank_local``: the backend does not slice again),
    and W is summed over them. Before each micro-batch the ranks agree that none of them saw the partition
    cancelled, so they stop together instead of one rank waiting in a collective for another that left.
    ``in_order``: micro-batches take ``keys`` in order, not whichever are ready first, so the ranks of one
    model replica (megatron's tensor/expert groups), which read the same keys, build the same micro-batches.

    ``whole_first`` (``mode.max_staleness=0``, where nothing overlaps anyway): wait for every row, then take
    the micro-batches in key order with the batch's totals known (:attr:`totals`), so each loss carries
    colocate's weight and nothing is rescaled afterwards: the step is colocate's, float rounding included.
    """

    rank_local = True

    def __init__(
        self,
        bus: DataBus,
        pad_token_id: int,
        part: str,
        keys: list[str],
        need: list[str],
        extras: list[str],
        algo,
        backend,
        in_order: bool = False,
        whole_first: bool = False,
    ) -> None:
        self.bus, self.pad, self.part, self.keys, self.in_order = bus, pad_token_id, part, keys, in_order
        self.whole_first = whole_first
        # (tokens, sequences) of the optimizer batch over every rank, when known before its first micro-batch
        self.totals: tuple[float, int] | None = None
        self.need, self.extras, self.algo, self.backend = need, extras, algo, backend
        self.size = len(keys)
        # streaming only: W, the un-normalised weights of every rank's micro-batches, once the last one went
        # through (whole_first needs none: :attr:`totals` weighs each micro-batch as it goes)
        self.total_weight: float | None = None
        self.wait_s = 0.0
        self.versions: list[int] = []
        self.bus_error: RayActorError | None = None

    def micro_batches(self, size: int) -> MicroStream:
        self.size = size
        return self

    def __len__(self) -> int:
        return math.ceil(len(self.keys) / self.size)

    def __iter__(self) -> Iterator[TrainBatch]:
        if self.whole_first:
            yield from self._whole_batch()
            return
        remaining, weight = list(self.keys), 0.0
        while remaining:
            t = time.perf_counter()
            want = min(self.size, len(remaining))
            rows = self._next_rows(want, set(remaining[:want] if self.in_order else remaining))
            if self.backend.any_over_ranks(rows is None):
                raise PartitionCancelled(self.part)
            self.wait_s += time.perf_counter() - t
            chosen, fields = rows
            remaining = [k for k in remaining if k not in set(chosen)]
            micro = batch_from_rows(fields, self.pad, self.extras)
            weight += micro_batch_weight(micro, 1.0, 1, self.algo)
            self.versions += micro.policy_versions.tolist()
            yield micro
        # the denominator the whole-batch micro_batch_weight uses, over every rank's rows
        (self.total_weight,) = self.backend.sum_over_ranks([weight])
        self.backend.scale_gradients(1.0 / max(self.total_weight, 1.0))

    def _whole_batch(self) -> Iterator[TrainBatch]:
        t = time.perf_counter()
        rows = self._next_rows(len(self.keys), set(self.keys))
        if self.backend.any_over_ranks(rows is None):
            raise PartitionCancelled(self.part)
        self.wait_s += time.perf_counter() - t
        chosen, fields = rows
        at = {key: i for i, key in enumerate(chosen)}
        order = [at[key] for key in self.keys]
        batch = batch_from_rows({k: [v[i] for i in order] for k, v in fields.items()}, self.pad, self.extras)
        micros = batch.micro_batches(self.size)
        tokens = sum(float(m.loss_mask.sum()) for m in micros)
        sequences = sum(sequence_count(m, self.algo) for m in micros)
        tokens, sequences = self.backend.sum_over_ranks([tokens, float(sequences)])
        self.totals = (tokens, int(sequences))
        for micro in micros:
            self.versions += micro.policy_versions.tolist()
            yield micro

    def _next_rows(self, want: int, pending: set[str]) -> tuple[list[str], Fields] | None:
        """``want`` rows of ``pending`` once that many are ready (keys, fields); None if the partition was
        cancelled meanwhile or the bus died (kept in ``bus_error``: every rank must stop together)."""
        try:
            ready = self.bus.wait_ready(self.part, self.need, None, want, among=pending)
            return ready[:want], get_rows(self.bus, self.part, ready[:want], self.need)
        except PartitionCancelled:
            return None
        except RayActorError as err:
            self.bus_error = err
            return None


class BusProducer:
    """Writes a step's scored prompt groups to the DataBus (mode=async). Users provide ``cfg``, ``bus`` and
    ``generate(prompts) -> samples`` (``n_samples_per_prompt`` per prompt, adjacent)."""

    cfg: Any
    bus: DataBus | None
    # generations resumed after an abort at a weight swap, reported per rollout call
    resumed: int = 0
    # whether ``generate`` plays episodes (environment or agent program), whose tool waits a chunk pays anew
    plays_episodes: bool = False

    def chunk_prompts(self, prompts: int) -> int:
        """Prompts per engine call. At staleness 0 a step is one call, as in colocate: the engine's sampler
        draws from one random stream, so chunks would draw other tokens than colocate's run of the same
        seed. Else ``mode.rollout_chunk_prompts`` (0: one call), whose null default means 4 prompts for
        single-turn generation and one call for episodes: each episode loop waits on its slowest tool
        call, and chunks run one after another, so each would pay that wait again."""
        m = self.cfg.mode
        chunk = m.rollout_chunk_prompts
        if chunk is None:
            chunk = 0 if self.plays_episodes else 4
        return (chunk if m.max_staleness else 0) or prompts

    def produce(self, step: int, prompts: list, slots: list[int], last_round: bool = True) -> RolloutRound:
        """Generate and score ``prompts`` chunk by chunk, writing whole prompt groups into the step's group
        ``slots`` on the bus (slot g holds positions g·n … g·n+n−1) as each chunk finishes.

        Dynamic sampling writes only groups with reward spread and stops once its slots are full; in the
        last round the slots still free get zero-spread groups with a zeroed loss mask, so the step keeps
        its size and the Actor's stream its shape, but those groups add nothing to the loss.
        """
        r, a = self.cfg.rollout, self.cfg.algorithm
        n, chunk = r.n_samples_per_prompt, self.chunk_prompts(len(prompts))
        out = RolloutRound()
        free, spare = list(slots), []
        for c in range(0, len(prompts), chunk):
            if not free:
                break
            samples = shape_rewards(self.generate(prompts[c : c + chunk]), a, r.max_new_tokens)
            out.generated_groups += len(samples) // n
            out.generated_rewards += [s.reward for s in samples]
            kept = with_spread(samples) if a.dynamic_sampling else samples
            kept_ids = {id(s) for s in kept}
            spare += [s for s in samples if id(s) not in kept_ids]
            groups = prompt_groups(kept, n)[: len(free)]
            out.kept_groups += len(groups)
            free = self._write(step, groups, free, out)
        if last_round and free:
            filler = [
                [replace(s, loss_mask=[0] * len(s.loss_mask)) for s in g] for g in prompt_groups(spare, n)
            ]
            free = self._write(step, filler[: len(free)], free, out)
        out.resumed = self.resumed
        return out

    def _write(self, step: int, groups: list[list[Sample]], free: list[int], out: RolloutRound) -> list[int]:
        """Put ``groups`` into the first free slots (one bus call); returns the slots still free."""
        if not groups:
            return free
        n = self.cfg.rollout.n_samples_per_prompt
        used, samples = free[: len(groups)], [s for g in groups for s in g]
        keys, fields = sample_rows(samples, 0, [sample_key(g * n + j) for g in used for j in range(n)])
        t = time.perf_counter()
        self.bus.put(partition_name(step), keys, fields)
        out.add_written(used, samples, time.perf_counter() - t)
        return free[len(groups) :]
