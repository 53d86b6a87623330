"""Where a role's model lives: its device, and the ranks of a multi-process Actor group.

One helper for every model-holding role (Actor, ActorFwd, Reference, Critic, Teacher, the torch rollout
engine), so "which accelerator did Ray give me" is answered once. The training world size covers both
backends: FSDP data-parallel ranks for ``trainer=torch`` and megatron's TP x PP x CP x DP grid.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from relax_core.errors import RelaxUserError
from relax_models.ports import free_port


def role_device() -> torch.device:
    """The accelerator Ray assigned to this process, else the CPU.

    Ray narrows ``CUDA_VISIBLE_DEVICES`` to the GPUs of the actor, so its GPU is ``cuda:0``; under
    torchrun ``LOCAL_RANK`` picks the device instead. A role without GPUs sees none and gets the CPU.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
    return torch.device("cuda", index)


def reserve(bundles: list[dict[str, float]], name: str, timeout_s: float = 120.0) -> Any:
    """A ready PACKed placement group of ``bundles`` named ``name``, or one error saying what is short."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    need: dict[str, float] = {}
    for bundle in bundles:
        for resource, amount in bundle.items():
            need[resource] = need.get(resource, 0.0) + amount
    have = ray.cluster_resources()
    short = {k: v for k, v in need.items() if v > have.get(k, 0.0) + 1e-9}
    if short:
        asked = ", ".join(f"{v:g} {k}" for k, v in short.items())
        held = ", ".join(f"{have.get(k, 0.0):g} {k}" for k in short)
        raise RelaxUserError(
            f"the roles of {name} need {asked} in Ray but the cluster has {held}: raise cluster.num_cpus/cluster.num_gpus "
            "or lower rollout.num_cpus/trainer.num_cpus (logical shares, not cores)"
        )
    pg = placement_group(bundles, strategy="PACK", name=name)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise RelaxUserError(
            f"Ray could not place {name} {bundles} within {timeout_s:g} s (free: {ray.available_resources()}): "
            "other work holds the resources, or no single node fits a bundle"
        ) from None
    return pg


def actor_world_size(trainer_cfg: Any) -> int:
    """Actor processes the trainer needs: ``trainer.dp_size`` FSDP ranks, or the megatron training world."""
    if trainer_cfg.backend == "megatron":
        from relax_models.megatron.launch import training_world_size

        return training_world_size(trainer_cfg.megatron, trainer_cfg.dp_size)
    return int(trainer_cfg.dp_size)


def helper_ranks(trainer_cfg: Any) -> int:
    """Processes of each model role besides the Actor (ActorFwd, Reference, Critic, Teacher): with FSDP
    they are sharded like the Actor, as many ranks in a process group of their own; else one."""
    fsdp = trainer_cfg.backend == "torch" and trainer_cfg.fsdp
    return actor_world_size(trainer_cfg) if fsdp else 1


def rank_env(rank: int, world_size: int, master_port: int, master_addr: str = "127.0.0.1") -> dict[str, str]:
    """The ``torch.distributed`` environment of Actor rank ``rank`` (torchrun's names).

    No ``LOCAL_RANK``: Ray shows each GPU actor only its own device, which is then ``cuda:0``.
    """
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def rank_envs(world_size: int) -> list[dict[str, str]] | None:
    """The environment of each rank of one ``world_size`` group on a free local port; None for one."""
    if world_size == 1:
        return None
    port = free_port()
    return [rank_env(i, world_size, port) for i in range(world_size)]


def data_parallel_size(trainer_cfg: Any) -> int:
    """Ranks that each train on their own slice of a batch."""
    if trainer_cfg.backend == "megatron":
        from relax_models.megatron.launch import data_parallel_size as megatron_dp

        return megatron_dp(trainer_cfg.megatron, trainer_cfg.dp_size)
    return int(trainer_cfg.dp_size)


def check_training_ranks(cfg: Any) -> None:
    """One-line errors for rank settings that cannot work (before Ray starts)."""
    t, r = cfg.trainer, cfg.rollout
    if t.dp_size < 1:
        raise RelaxUserError(f"trainer.dp_size={t.dp_size} must be >= 1")
    if t.backend == "torch" and t.dp_size > 1 and not t.fsdp:
        raise RelaxUserError(
            f"trainer.dp_size={t.dp_size} shards the Actor with FSDP: set trainer.fsdp=true (or trainer=fsdp)"
        )
    dp = data_parallel_size(t)
    if dp == 1:
        return
    batches = {"trainer.global_batch_size": t.global_batch_size} if t.global_batch_size else {}
    if not t.global_batch_size:
        batches["rollout.batch_size x rollout.n_samples_per_prompt"] = r.batch_size * r.n_samples_per_prompt
    if t.sft_warmup_steps:
        batches["trainer.sft_batch_size"] = t.sft_batch_size
    for key, size in batches.items():
        if size % dp:
            raise RelaxUserError(
                f"{key}={size} does not divide over {dp} data-parallel ranks (trainer.dp_size)"
            )
