"""Actor role: the policy under training. A second instance with no optimizer steps serves as ActorFwd
(log-probs of the behaviour policy) when a rollout batch is split into several optimizer steps."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from relax_core.algorithms.masked import masked_mean
from relax_core.algorithms.objective import micro_batch_weight, policy_objective, sequence_count
from relax_core.algorithms.sampling_rules import FROZEN_ACTOR_METRICS, critic_warming_up
from relax_core.backends import build_backend
from relax_core.backends.base import SKIPPED_STEPS
from relax_core.databus import DataBus, PartitionCancelled, partition_name, sample_key
from relax_core.databus.stages import BusStep, MicroStream, score_stage
from relax_core.engines import adapter_sync_rank
from relax_core.errors import nonfinite_weights_error
from relax_core.roles import use_threads
from relax_core.runtime.placement import actor_world_size, data_parallel_size
from relax_core.samples import TrainBatch
from relax_core.weight_transfer import WeightReceiver, WeightSource
from relax_models.loader import load_tokenizer

if TYPE_CHECKING:
    from relax_core.config.schema import AlgorithmConfig, RelaxConfig


def effective_algorithm(cfg: RelaxConfig) -> AlgorithmConfig:
    """The algorithm config the loss uses: ``algorithm.tis_cap``, else the mode's off-policy cap when
    samples can be stale (``mode.max_staleness > 0``); strictly on-policy runs keep no correction.
    ``algorithm.loss_scale`` unset is the generation budget ``rollout.max_new_tokens``: a constant, where
    the aggregation's own default (the micro-batch's width) would make the loss depend on the split."""
    a, m = cfg.algorithm, cfg.mode
    if a.tis_cap is None and m.max_staleness > 0 and m.off_policy_tis_cap is not None:
        a = dataclasses.replace(a, tis_cap=m.off_policy_tis_cap)
    if a.loss_scale is None:
        a = dataclasses.replace(a, loss_scale=float(cfg.rollout.max_new_tokens))
    return a


def staleness_metrics(versions: list[int], trained_version: int) -> dict[str, float]:
    """staleness = version the Actor trains from − version that generated the sample (0 = on-policy)."""
    lags = [trained_version - v for v in versions] or [0]
    return {
        "staleness/min": float(min(lags)),
        "staleness/mean": sum(lags) / len(lags),
        "staleness/max": float(max(lags)),
    }


def per_update(sums: dict[str, float], updates: int) -> dict[str, float]:
    """Metrics summed over a step's ``updates`` optimizer updates -> their means; skipped updates stay a
    count (``train/skipped_steps``)."""
    out = {k: v if k == SKIPPED_STEPS else v / updates for k, v in sums.items()}
    return out | {"optimizer_steps": float(updates)}


class Actor(WeightSource, WeightReceiver):
    def __init__(
        self, cfg: RelaxConfig, model_path: str, replica: int = 0, bus: DataBus | None = None
    ) -> None:
        """``replica``: this process's rank in a multi-process Actor group (FSDP data-parallel ranks, or
        the megatron training world; see ``relax_core.runtime.placement.actor_world_size``).

        Every rank gets every call with the whole batch and runs it collectively (its backend trains on
        the rank's own slice); only rank 0 returns weights (:meth:`state_dict`), the others an empty dict.
        ``bus``: the DataBus it reads its steps from in mode=async.
        """
        use_threads(cfg.trainer.num_threads)
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.algo = effective_algorithm(cfg)
        self.rank, self.ranks = replica, data_parallel_size(cfg.trainer)
        self.bus = bus
        self.pad = load_tokenizer(model_path).pad_token_id if bus is not None else 0
        self.backend = build_backend(
            cfg.trainer.backend,
            model_path,
            cfg.trainer,
            cfg.model,
            temperature=cfg.rollout.temperature,
            seed=cfg.seed,
        )
        # R3: the log-prob and training forwards replay the rollout engine's MoE routing (torch backend)
        self.backend.routing_replay = cfg.algorithm.routing_replay
        # LoRA adapter sync: versions go out as adapter payloads (engines that serve LoRA: vLLM)
        self.backend.engine_adapters = adapter_sync_rank(cfg) > 0
        self._in_warm_start = False

    def offload(self) -> None:
        """mode=colocate with ``trainer.offload``: leave the device to the rollout engines."""
        self.backend.offload()

    def onload(self) -> None:
        self.backend.onload()

    def compute_log_probs(self, batch: TrainBatch) -> torch.Tensor:
        return self.backend.forward_logprobs(batch, self.cfg.trainer.micro_batch_size)

    def sft_step(self, batch: TrainBatch) -> dict[str, float]:
        """Supervised warm-start: maximise the log-likelihood of the response tokens (token mean).

        Runs with its own optimizer at ``trainer.sft_lr``; :meth:`end_warm_start` hands over to RL.
        """
        if not self._in_warm_start:
            self.backend.set_warm_start(True)
            self.backend.reset_optimizer(self.cfg.trainer.sft_lr)
            self._in_warm_start = True

        def nll(micro: TrainBatch, logprobs: torch.Tensor, entropy: torch.Tensor):
            weight = float(micro.loss_mask.sum()) / max(float(batch.loss_mask.sum()), 1.0)
            return -masked_mean(logprobs, micro.loss_mask) * weight, {}

        return self.backend.train_step(batch, nll, self.cfg.trainer.micro_batch_size)

    def end_warm_start(self) -> None:
        """Fresh optimizer state at ``trainer.lr`` so Adam moments of the supervised phase do not leak."""
        self.backend.set_warm_start(False)
        self.backend.reset_optimizer(self.cfg.trainer.lr)
        self._in_warm_start = False

    def train(self, step: int, rows: TrainBatch | BusStep) -> dict[str, float]:
        """``algorithm.ppo_epochs`` passes over step ``step``'s rows, one optimizer step per global batch;
        during PPO's critic warm-up the policy does not move.

        ``rows``: the batch in hand (mode=colocate), or a :class:`BusStep`, the step's rows on the DataBus
        (mode=async): micro-batches then stream into the backend as soon as their fields are ready, each
        data-parallel rank streaming its contiguous share of every optimizer batch (what
        :func:`~relax_core.backends.base.rank_slice` gives it of a batch in hand), and the version is kept to
        publish while the next step trains."""
        algo, trainer = self.algo, self.cfg.trainer
        on_bus = isinstance(rows, BusStep)
        frozen = critic_warming_up(algo, step)  # version ``step`` is then version step−1's weights
        total = rows.total if on_bus else len(rows)
        global_size = trainer.global_batch_size or total
        sums: dict[str, float] = {}
        updates, wait_s, versions = 0, 0.0, []
        t0 = time.perf_counter()
        try:
            for epoch in range(0 if frozen else algo.ppo_epochs):
                for start in range(0, total, global_size):
                    end = min(start + global_size, total)
                    if on_bus:
                        part, totals = self._stream(step, rows, start, end), None
                    else:
                        part = rows.select(list(range(start, end)))
                        totals = (float(part.loss_mask.sum()), sequence_count(part, algo))
                    loss_fn = functools.partial(self._loss, part, totals)
                    out = self.backend.train_step(part, loss_fn, trainer.micro_batch_size)
                    if on_bus:
                        if part.totals is None:  # the gradients were scaled after the fact; the loss is too
                            out["loss"] = out["loss"] / max(part.total_weight, 1.0)
                        wait_s += part.wait_s
                        versions += part.versions if epoch == 0 else []
                    for k, v in out.items():
                        sums[k] = sums.get(k, 0.0) + v
                    updates += 1
        except PartitionCancelled:  # the step is being regenerated; the next train_step zeroes the gradients
            if part.bus_error is not None and not updates:
                raise part.bus_error from None  # nothing trained: the scheduler recovers and regenerates the step
            # after an update the scheduler must know this step is half-trained (restart from a checkpoint)
            return {"cancelled": 1.0, "optimizer_steps": float(updates)}
        metrics = FROZEN_ACTOR_METRICS | {"optimizer_steps": 0.0} if frozen else per_update(sums, updates)
        if on_bus:
            self.weights_snapshot(step)
            metrics |= staleness_metrics(self._from_every_rank(versions), step - 1)
            metrics["time/actor_data_wait_s"] = wait_s
            metrics["time/actor_busy_s"] = time.perf_counter() - t0 - wait_s
        return metrics

    def _stream(self, step: int, rows: BusStep, start: int, end: int) -> MicroStream:
        """This rank's share of the optimizer batch of rows ``start``..``end`` of step ``step`` on the bus."""
        share = (end - start) // self.ranks
        replica = self.backend.data_parallel_rank(self.rank)
        keys = [sample_key(i) for i in range(start + replica * share, start + (replica + 1) * share)]
        return MicroStream(
            self.bus,
            self.pad,
            partition_name(step),
            keys,
            rows.need,
            rows.extras,
            self.algo,
            self.backend,
            # megatron: the ranks of one model replica stream the same rows (in order, so in step)
            in_order=actor_world_size(self.cfg.trainer) > self.ranks,
            # nothing overlaps at staleness 0: take colocate's exact weights
            whole_first=self.cfg.mode.max_staleness == 0,
        )

    def _from_every_rank(self, values: list[int]) -> list[int]:
        """Every data-parallel rank's ``values``, concatenated (collective)."""
        if self.ranks == 1:
            return values
        gathered: list[list[int]] = [[] for _ in range(self.ranks)]
        dist.all_gather_object(gathered, values)
        return [v for part in gathered for v in part]

    def _loss(
        self,
        part: TrainBatch | MicroStream,
        totals: tuple[float, int] | None,
        micro: TrainBatch,
        logprobs: torch.Tensor,
        entropy: torch.Tensor,
    ):
        """The objective of one micro-batch of the optimizer batch ``part``, weighed by its share of the batch
        (``totals``: the batch's tokens and sequences, or the stream's once it knows them; else un-normalised
        and the stream scales the gradients once the batch is complete), plus the train-vs-rollout log-prob
        mismatch."""
        algo = self.algo
        weight = micro_batch_weight(micro, *(totals or part.totals or (1.0, 1)), algo)
        loss, m = policy_objective(micro, logprobs, entropy, algo, weight)
        mask, lp = micro.loss_mask, logprobs.detach()
        m["off_policy/train_rollout_abs_diff"] = float(masked_mean((lp - micro.rollout_logprobs).abs(), mask))
        if "old_logprobs" in micro.extras:
            old = micro.extras["old_logprobs"]
            m["off_policy/old_rollout_abs_diff"] = float(
                masked_mean((old - micro.rollout_logprobs).abs(), mask)
            )
        return loss, m

    def process(self, step: int, total: int) -> dict[str, float]:
        """As ActorFwd (mode=async): the behaviour policy's log-probs (version N−1) of step N's rows."""
        chunk = self.cfg.trainer.micro_batch_size
        return score_stage(
            self.bus, self.pad, step, total, "actor_fwd", "old_logprobs", chunk, self.compute_log_probs
        )

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """As ActorFwd: follow the policy's published versions."""
        self.backend.load_state_dict(state_dict)

    def state_dict(self) -> dict[str, torch.Tensor]:
        weights = self.backend.state_dict()  # collective: every rank gathers its shards
        return weights if self.rank == 0 else {}

    def _published(self) -> dict[str, torch.Tensor]:
        return self.backend.publish_weights()  # LoRA adapter sync: the adapter payload

    def publish_weights(self) -> dict[str, torch.Tensor]:
        """What a published version carries (collective); rank 0 returns it."""
        weights = self._published()
        return weights if self.rank == 0 else {}

    def save_checkpoint(self, path: str) -> None:
        self.check_finite_weights(path)
        self.backend.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.backend.load_checkpoint(path)

    def export_hf(self, path: str) -> None:
        self.check_finite_weights(path)
        self.backend.export_hf(path)

    def count_nonfinite_weights(self) -> tuple[int, str | None]:
        """How many policy weight tensors hold NaN or inf, summed over the ranks (collective), and the name
        of one on this rank. The driver checks it before a save or export, so that the run ends with its own
        one-line error rather than one raised in here, which Ray would wrap under its own header."""
        bad = self.backend.nonfinite_weights()
        count = len(bad)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            total = torch.tensor([count], device=getattr(self.backend, "device", None))
            dist.all_reduce(total)
            count = int(total.item())
        return count, (bad[0] if bad else None)

    def check_finite_weights(self, path: str) -> None:
        """Refuse to write ``path`` from NaN/inf weights, also when called other than from the run loop
        (collective: all ranks raise together)."""
        count, example = self.count_nonfinite_weights()
        if count:
            raise nonfinite_weights_error(path, count, example)
