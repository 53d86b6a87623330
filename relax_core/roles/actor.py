"""Actor role: the policy under training. It also serves as ActorFwd (old log-probs) in colocate mode."""

from __future__ import annotations

import torch

from relax_core.algorithms.masked import masked_mean
from relax_core.algorithms.objective import micro_batch_weight, policy_objective, sequence_count
from relax_core.backends import build_backend
from relax_core.samples import TrainBatch


class Actor:
    def __init__(self, cfg, model_path: str, replica: int = 0) -> None:
        """``replica``: this process's rank in a multi-process Actor group (FSDP data-parallel ranks, or
        the megatron training world; see ``relax_core.placement.actor_world_size``).

        Every rank gets every call with the whole batch and runs it collectively (its backend trains on
        the rank's own slice); only rank 0 returns weights (:meth:`state_dict`), the others an empty dict.
        """
        torch.set_num_threads(cfg.trainer.num_threads)
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.rank = replica
        self.backend = build_backend(
            cfg.trainer.backend,
            model_path,
            cfg.trainer,
            cfg.model,
            temperature=cfg.rollout.temperature,
            seed=cfg.seed,
        )
        self._in_warm_start = False

    def compute_log_probs(self, batch: TrainBatch) -> torch.Tensor:
        return self.backend.forward_logprobs(batch, self.cfg.trainer.micro_batch_size)

    def sft_step(self, batch: TrainBatch) -> dict[str, float]:
        """Supervised warm-start: maximise the log-likelihood of the response tokens (token mean).

        Runs with its own optimizer at ``trainer.sft_lr``; :meth:`end_warm_start` hands over to RL.
        """
        if not self._in_warm_start:
            self.backend.reset_optimizer(self.cfg.trainer.sft_lr)
            self._in_warm_start = True

        def nll(micro: TrainBatch, logprobs: torch.Tensor, entropy: torch.Tensor):
            weight = float(micro.loss_mask.sum()) / max(float(batch.loss_mask.sum()), 1.0)
            return -masked_mean(logprobs, micro.loss_mask) * weight, {}

        return self.backend.train_step(batch, nll, self.cfg.trainer.micro_batch_size)

    def end_warm_start(self) -> None:
        """Fresh optimizer state at ``trainer.lr`` so Adam moments of the supervised phase do not leak."""
        self.backend.reset_optimizer(self.cfg.trainer.lr)
        self._in_warm_start = False

    def train(self, batch: TrainBatch) -> dict[str, float]:
        """``algorithm.ppo_epochs`` passes over ``batch``, one optimizer step per global batch."""
        algo, trainer = self.cfg.algorithm, self.cfg.trainer
        global_size = trainer.global_batch_size or len(batch)
        metrics: dict[str, float] = {}
        updates = 0
        for _ in range(algo.ppo_epochs):
            for start in range(0, len(batch), global_size):
                mini = batch.select(list(range(start, min(start + global_size, len(batch)))))
                total_tokens, total_seqs = float(mini.loss_mask.sum()), sequence_count(mini, algo)

                def loss_fn(micro, logprobs, entropy, _t=total_tokens, _s=total_seqs):
                    return policy_objective(
                        micro, logprobs, entropy, algo, micro_batch_weight(micro, _t, _s, algo)
                    )

                for k, v in self.backend.train_step(mini, loss_fn, trainer.micro_batch_size).items():
                    metrics[k] = metrics.get(k, 0.0) + v
                updates += 1
        return {k: v / updates for k, v in metrics.items()} | {"optimizer_steps": float(updates)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        weights = self.backend.state_dict()  # collective: every rank gathers its shards
        return weights if self.rank == 0 else {}

    def save_checkpoint(self, path: str) -> None:
        self.backend.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.backend.load_checkpoint(path)

    def export_hf(self, path: str) -> None:
        self.backend.export_hf(path)
