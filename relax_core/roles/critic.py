"""Critic role (PPO): a scalar value head on a copy of the policy architecture, trained on GAE returns."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from relax_core.algorithms.advantages import gae, last_token_rewards
from relax_core.algorithms.value import clipped_value_loss
from relax_core.databus import DataBus, partition_name, sample_key
from relax_core.databus.records import FORWARD_FIELDS, SAMPLE_FIELDS, batch_from_rows, get_rows
from relax_core.databus.stages import score_stage
from relax_core.roles import use_threads
from relax_core.samples import TrainBatch
from relax_models.loader import load_tokenizer

if TYPE_CHECKING:
    from relax_core.config.schema import RelaxConfig


class Critic:
    def __init__(
        self, cfg: RelaxConfig, model_path: str, bus: DataBus | None = None, sharded: bool = False
    ) -> None:
        """``sharded``: this process is one rank of a group as large as the Actor's (colocate mode with
        ``trainer.fsdp``): the value model is FSDP-sharded over it and every call runs collectively."""
        use_threads(cfg.trainer.num_threads)
        self.bus = bus
        self.pad = load_tokenizer(model_path).pad_token_id if bus is not None else 0
        torch.manual_seed(cfg.seed + 17)
        if cfg.algorithm.critic is None:
            raise ValueError("the Critic role needs algorithm.critic")
        self.cfg = cfg.algorithm.critic
        self.gamma, self.lam = cfg.algorithm.gamma, cfg.algorithm.lam
        # imported here: the value backend brings FSDP's modules (~0.9 s), which a run without a Critic
        # (every algorithm but PPO) would pay at every launch for nothing
        from relax_core.backends.value_backend import ShardedValueBackend, ValueBackend

        backend = ShardedValueBackend if sharded else ValueBackend
        self.backend = backend(model_path, self.cfg, cfg.model)

    @torch.no_grad()
    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """V ``[B, R]`` for every response token (0 at masked tokens)."""
        return self.backend.forward_logprobs(batch, self.cfg.micro_batch_size)

    def process(self, step: int, total: int) -> dict[str, float]:
        """mode=async: write ``values`` for every row of step N, then fit them on the whole step (the values
        of step N+1 therefore come from the critic trained on step N, as in colocate)."""
        metrics = score_stage(
            self.bus,
            self.pad,
            step,
            total,
            "critic",
            "values",
            self.cfg.micro_batch_size,
            self.compute_values,
        )
        keys = [sample_key(i) for i in range(total)]
        rows = get_rows(self.bus, partition_name(step), keys, SAMPLE_FIELDS + FORWARD_FIELDS + ["values"])
        return metrics | self.fit(batch_from_rows(rows, self.pad, ["values"]))

    def fit(self, batch: TrainBatch) -> dict[str, float]:
        """Regress on the GAE returns R_t = A_t + V_t of ``batch`` (rewards and ``extras['values']``)."""
        values, mask = batch.extras["values"], batch.loss_mask
        _, batch.extras["returns"] = gae(
            last_token_rewards(batch.rewards, mask), values, mask, self.gamma, self.lam
        )
        metrics = self.train(batch)
        metrics["critic/values_mean"] = float((values * mask).sum() / mask.sum().clamp_min(1))
        return metrics

    def train(self, batch: TrainBatch) -> dict[str, float]:
        """``critic.epochs`` optimizer steps on the clipped value loss against ``extras['returns']``.

        ``extras['values']`` are the values the advantages were computed with (V_old of the clip).
        """
        total_tokens = max(float(batch.loss_mask.sum()), 1.0)

        def loss_fn(micro: TrainBatch, values: torch.Tensor, _entropy: torch.Tensor):
            loss, metrics = clipped_value_loss(
                values, micro.extras["values"], micro.extras["returns"], micro.loss_mask, self.cfg.value_clip
            )
            share = float(micro.loss_mask.sum()) / total_tokens
            return loss * share, {k: float(v) for k, v in metrics.items()}

        sums: dict[str, float] = {}
        for _ in range(self.cfg.epochs):
            out = self.backend.train_step(batch, loss_fn, self.cfg.micro_batch_size)
            out = {"critic/vf_loss": out.pop("loss"), "critic/grad_norm": out.pop("grad_norm")} | out
            out.pop("lr", None)
            for k, v in out.items():
                sums[k] = sums.get(k, 0.0) + v
        return {k: v / self.cfg.epochs for k, v in sums.items()}

    def save_checkpoint(self, path: str) -> None:
        """Value model, optimizer (the Adam moments matter: a resumed critic must not re-warm), RNG."""
        self.backend.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.backend.load_checkpoint(path)

    def load_trunk(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Start the value trunk from the policy's weights (after the supervised warm-start)."""
        self.backend.load_trunk(state_dict)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.backend.state_dict()
