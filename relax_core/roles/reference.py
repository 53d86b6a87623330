"""Reference role: frozen initial policy, scores responses for the KL term."""

from __future__ import annotations

import dataclasses

import torch

from relax_core.config.schema import MegatronParallelConfig, RelaxConfig
from relax_core.databus import DataBus
from relax_core.roles.scorer import FrozenScorer
from relax_core.weight_transfer import WeightReceiver


class Reference(FrozenScorer, WeightReceiver):
    stage = "reference"
    column = "ref_logprobs"

    def __init__(
        self, cfg: RelaxConfig, model_path: str, bus: DataBus | None = None, sharded: bool = False
    ) -> None:
        trainer_cfg = cfg.trainer
        if trainer_cfg.backend == "megatron":  # a frozen scorer runs alone: no model-parallel group
            trainer_cfg = dataclasses.replace(trainer_cfg, megatron=MegatronParallelConfig())
        super().__init__(cfg, model_path, cfg.trainer.backend, trainer_cfg, bus, sharded)

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int = 0) -> None:
        """The warm-started policy (and, with ``mode.ref_update_interval``, later versions)."""
        self.backend.load_state_dict(state_dict)

    def save_checkpoint(self, path: str) -> None:
        """Its weights: a checkpoint keeps them (they are not the Actor's), and a replica restarted in place
        reloads them from the run's copy."""
        self.backend.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.backend.load_checkpoint(path)
