"""Reference role: frozen initial policy, scores responses for the KL term."""

from __future__ import annotations

import torch

from relax_core.backends import build_backend
from relax_core.samples import TrainBatch


class Reference:
    def __init__(self, cfg, model_path: str) -> None:
        torch.set_num_threads(cfg.trainer.num_threads)
        self.micro_batch_size = cfg.trainer.micro_batch_size
        self.backend = build_backend(
            cfg.trainer.backend,
            model_path,
            cfg.trainer,
            cfg.model,
            cfg.rollout.temperature,
            cfg.seed,
            trainable=False,
        )

    def compute_ref_log_probs(self, batch: TrainBatch) -> torch.Tensor:
        return self.backend.forward_logprobs(batch, self.micro_batch_size)

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.backend.load_state_dict(state_dict)
