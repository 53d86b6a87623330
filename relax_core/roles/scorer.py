"""A frozen model that scores the policy's sampled tokens: the base of the Reference and Teacher roles."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from relax_core.backends import build_backend
from relax_core.databus import DataBus
from relax_core.databus.stages import score_stage
from relax_core.roles import use_threads
from relax_core.samples import TrainBatch
from relax_models.loader import load_tokenizer

if TYPE_CHECKING:
    from relax_core.config.schema import RelaxConfig, TrainerConfig


class FrozenScorer:
    """log π of the response tokens under a frozen model: on request in colocate mode, from the bus in async.

    ``sharded``: this process is one rank of a group as large as the Actor's (colocate mode with
    ``trainer.fsdp``): the frozen model is FSDP-sharded over it and every call runs collectively.
    """

    stage: str  # the bus stage this role serves in mode=async
    column: str  # the bus column its log-probs go to

    def __init__(
        self,
        cfg: RelaxConfig,
        model_path: str,
        backend: str,
        trainer_cfg: TrainerConfig,
        bus: DataBus | None,
        sharded: bool,
    ) -> None:
        use_threads(cfg.trainer.num_threads)
        self.micro_batch_size = cfg.trainer.micro_batch_size
        self.bus = bus
        self.pad = load_tokenizer(model_path).pad_token_id if bus is not None else 0
        self.backend = build_backend(
            backend,
            model_path,
            trainer_cfg,
            cfg.model,
            cfg.rollout.temperature,
            cfg.seed,
            trainable=False,
            sharded=sharded,
        )

    def compute_log_probs(self, batch: TrainBatch) -> torch.Tensor:
        """log π_frozen of the sampled response tokens ``[B, R]``, at the rollout temperature."""
        return self.backend.forward_logprobs(batch, self.micro_batch_size)

    def process(self, step: int, total: int) -> dict[str, float]:
        """mode=async: the log-probs of step ``step``'s rows, as they land on the bus."""
        return score_stage(
            self.bus,
            self.pad,
            step,
            total,
            self.stage,
            self.column,
            self.micro_batch_size,
            self.compute_log_probs,
        )
