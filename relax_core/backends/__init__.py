"""Training backends behind :class:`relax_core.backends.base.TrainingBackend`, built by name."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax_core.backends.base import TrainingBackend
from relax_core.errors import RelaxUserError

if TYPE_CHECKING:
    from relax_core.config.schema import ModelConfig, TrainerConfig


def build_backend(
    name: str,
    model_path: str,
    trainer_cfg: TrainerConfig,
    model_cfg: ModelConfig,
    temperature: float,
    seed: int,
    trainable: bool = True,
    sharded: bool | None = None,
) -> TrainingBackend:
    """The backend ``trainer.backend`` names; ``trainable=False`` for frozen scorers (Reference).

    ``trainer.fsdp`` shards a torch model over the process group of its role's ranks when ``sharded``
    (default: ``trainable``): the Actor's data-parallel ranks, and in colocate mode the Reference and the
    Teacher, whose groups have as many ranks. Other frozen scorers run as one unsharded process.
    """
    shard = trainable if sharded is None else sharded
    if name == "torch" and shard and getattr(trainer_cfg, "fsdp", False):
        from relax_core.backends.fsdp_backend import FSDPBackend

        return FSDPBackend(model_path, trainer_cfg, model_cfg, temperature=temperature, trainable=trainable)
    if name == "torch":
        from relax_core.backends.torch_backend import TorchBackend

        return TorchBackend(model_path, trainer_cfg, model_cfg, temperature=temperature, trainable=trainable)
    if name == "megatron":
        from relax_core.backends.megatron_backend import MegatronBackend

        return MegatronBackend(
            model_path, trainer_cfg, model_cfg, seed, temperature=temperature, trainable=trainable
        )
    raise RelaxUserError(f"trainer.backend={name!r} is not available; choose one of ['megatron', 'torch']")
