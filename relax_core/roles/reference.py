"""Reference role: frozen initial policy, scores responses for the KL term."""

from __future__ import annotations

import dataclasses

import torch

from relax_core.backends import build_backend
from relax_core.config import MegatronParallelConfig
from relax_core.samples import TrainBatch


class Reference:
    def __init__(self, cfg, model_path: str) -> None:
        torch.set_num_threads(cfg.trainer.num_threads)
        self.micro_batch_size = cfg.trainer.micro_batch_size
        trainer_cfg = cfg.trainer
        if trainer_cfg.backend == "megatron":  # a frozen scorer runs alone: no model-parallel group
            trainer_cfg = dataclasses.replace(trainer_cfg, megatron=MegatronParallelConfig())
        self.backend = build_backend(
            cfg.trainer.backend,
            model_path,
            trainer_cfg,
            cfg.model,
            cfg.rollout.temperature,
            cfg.seed,
            trainable=False,
        )

    def compute_ref_log_probs(self, batch: TrainBatch) -> torch.Tensor:
        return self.backend.forward_logprobs(batch, self.micro_batch_size)

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.backend.load_state_dict(state_dict)
