"""Reference role: frozen initial policy, scores responses for the KL term."""

from __future__ import annotations

import dataclasses

import torch

from relax_core.backends import build_backend
from relax_core.config import MegatronParallelConfig
from relax_core.databus import DataBus
from relax_core.databus.stages import score_stage
from relax_core.roles import use_threads
from relax_core.samples import TrainBatch
from relax_core.weight_transfer import WeightReceiver
from relax_models.loader import load_tokenizer


class Reference(WeightReceiver):
    def __init__(self, cfg, model_path: str, bus: DataBus | None = None, sharded: bool = False) -> None:
        """``sharded``: this process is one rank of a group as large as the Actor's (colocate mode with
        ``trainer.fsdp``): the frozen model is FSDP-sharded over it and every call runs collectively."""
        use_threads(cfg.trainer.num_threads)
        self.micro_batch_size = cfg.trainer.micro_batch_size
        self.bus = bus
        self.pad = load_tokenizer(model_path).pad_token_id if bus is not None else 0
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
            sharded=sharded,
        )

    def compute_ref_log_probs(self, batch: TrainBatch) -> torch.Tensor:
        return self.backend.forward_logprobs(batch, self.micro_batch_size)

    def process(self, step: int, total: int) -> dict[str, float]:
        """mode=async: ref log-probs of step ``step``'s rows, as they land on the bus."""
        return score_stage(
            self.bus,
            self.pad,
            step,
            total,
            "reference",
            "ref_logprobs",
            self.micro_batch_size,
            self.compute_ref_log_probs,
        )

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int = 0) -> None:
        """The warm-started policy (and, with ``mode.ref_update_interval``, later versions)."""
        self.backend.load_state_dict(state_dict)

    def save_checkpoint(self, path: str) -> None:
        """Its weights: a checkpoint keeps them (they are not the Actor's), and a replica restarted in place
        reloads them from the run's copy."""
        self.backend.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.backend.load_checkpoint(path)
