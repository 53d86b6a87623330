"""The torch backend sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``) over data-parallel ranks.

One instance runs in each Actor rank (``trainer.dp_size`` ranks, gloo on CPU, NCCL on GPU), and in colocate
mode in each rank of the Reference and the Teacher (frozen: no optimizer) and of the Critic (with a value
head: ``ShardedValueBackend``). Every rank builds the model on the meta device;
rank 0 alone reads the weights and sends each rank its shards, so no other rank holds the full model. Every method
that touches weights is collective: the driver calls all ranks with the *whole* batch and each rank trains
on its own contiguous slice. Gradients are averaged by FSDP's reduce-scatter, so each rank scales its
gradient by the rank count: N ranks then take exactly the step one rank takes on the global batch.

Parameters, gradients and AdamW state exist only as shards (``DTensor``); gradient clipping uses the norm
over all shards; checkpoints go through ``torch.distributed.checkpoint`` (one shard file per rank, plus each
rank's scheduler and RNG state); weights leave the group gathered one bucket at a time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from relax_core.backends.base import (
    LossFn,
    accumulate_gradients,
    max_over_ranks,
    pad_to_width,
    rank_slice,
    reduce_metrics,
    scatter_rows,
    split_groups,
)
from relax_core.backends.torch_backend import TorchBackend, rng_state, set_rng_state
from relax_core.runtime.placement import join_rendezvous
from relax_core.samples import TrainBatch
from relax_models.loader import load_tokenizer
from relax_models.lora import is_adapter, merged_payload, merged_weights, peft_names, zero_adapters
from relax_models.megatron.cpu_shim import init_process_group
from relax_models.weight_buckets import bucket_by_bytes

if TYPE_CHECKING:
    from peft import LoraConfig

    from relax_core.config.schema import ModelConfig, TrainerConfig


class FSDPBackend(TorchBackend):
    """An HF model whose decoder layers and root are ``fully_shard``-ed over the default process group."""

    def __init__(
        self,
        model_path: str,
        trainer_cfg: TrainerConfig,
        model_cfg: ModelConfig,
        temperature: float = 1.0,
        trainable: bool = True,
    ):
        join_rendezvous()  # MASTER_ADDR/PORT of the group, wherever Ray put its ranks
        init_process_group()  # from RANK / WORLD_SIZE / MASTER_*; a lone process gets a group of one
        self.rank, self.ranks = dist.get_rank(), dist.get_world_size()
        super().__init__(model_path, trainer_cfg, model_cfg, temperature=temperature, trainable=trainable)

    def _load_device(self) -> torch.device:
        """The meta device: every rank builds the architecture only; :meth:`_shard` fills in its shards."""
        return torch.device("meta")

    def _shard(self) -> None:
        """Shard the meta model, allocate this rank's shards on its device, and fill them from the weights
        rank 0 alone reads (on the CPU): no other rank ever holds the full model."""
        mesh = init_device_mesh(self.device.type, (self.ranks,))
        # fp32 shards (master weights) of a trainable model are gathered in model.dtype for the forward and
        # its gradients reduced in fp32; a frozen model's shards are in model.dtype already (no cast)
        mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        # one unit per decoder layer (its all-gather overlaps the previous layer's compute on GPU), then
        # the root for embeddings, final norm and the (possibly tied) head
        for layer in _decoder_layers(self.model):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(self.model, mesh=mesh, mp_policy=mp)
        self.model.to_empty(device=self.device)
        cpu = torch.device("cpu")
        source = self._build_model(self.model_path, self.model_cfg, cpu) if self.rank == 0 else None
        if source is not None:
            self._apply_lora(source)  # LoRA: rank 0's initial adapters reach every rank with the weights
        set_model_state_dict(
            self.model,
            source.state_dict() if source is not None else {},
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )
        # buffers outside the state dict (rotary ``inv_freq``) are computed at construction, which the
        # meta device skipped: rank 0 sends its own
        source_buffers = dict(source.named_buffers()) if source is not None else {}
        for name, buffer in self.model.named_buffers():
            if source is not None:
                buffer.copy_(source_buffers[name])
            dist.broadcast(buffer, src=0)

    def _apply_lora(self, model: torch.nn.Module) -> LoraConfig | None:
        """The meta model's adapter init must not draw from the RNG: rank 0's source model then draws the
        adapters an unsharded run would, and those reach every rank with the weights."""
        if next(model.parameters()).is_meta:
            with torch.random.fork_rng(devices=[]):
                return super()._apply_lora(model)
        return super()._apply_lora(model)

    def _cast_forward(self) -> None:
        """Nothing to wrap: the ``MixedPrecisionPolicy`` given to ``fully_shard`` casts the forward."""

    # ------------------------------------------------------------------ forward / train
    @torch.no_grad()
    def forward_logprobs(self, batch: TrainBatch, micro_batch_size: int = 64) -> torch.Tensor:
        """Each rank scores its slice; the slices are gathered so every rank returns ``[B, R]``."""
        width = batch.loss_mask.shape[1]
        local = rank_slice(batch, self.rank, self.ranks)
        groups = self._budget_groups(local)
        if groups is None:
            parts = [self._logprobs_entropy(mb)[0] for mb in local.micro_batches(micro_batch_size)]
            mine = pad_to_width(parts, width)
        else:
            packed = [self._packed_logprobs_entropy(local.select(rows))[0] for rows in groups]
            mine = scatter_rows(packed, groups, width)
        # gathered on the device the group serves (NCCL takes no CPU tensor), returned on the CPU
        mine = mine.to(self.device)
        gathered = [torch.empty_like(mine) for _ in range(self.ranks)]
        dist.all_gather(gathered, mine)
        self.model.reshard()  # FSDP keeps the root's weights gathered after a forward, for a backward to come
        return torch.cat(gathered).cpu()

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, micro_batch_size: int) -> dict[str, float]:
        """``loss_fn`` weighs micro-batches against the *global* batch (the driver built it from the whole
        batch), so the ranks' losses are shares of one loss and their gradients add up to its gradient."""
        assert self.optimizer is not None, "train_step on a frozen backend"
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        local = rank_slice(batch, self.rank, self.ranks)
        groups = self._budget_groups(local)
        out = accumulate_gradients(local, self._train_logprobs, loss_fn, micro_batch_size, self.ranks, groups)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.trainer_cfg.grad_clip)
        # reduced before deciding: every rank sees the global loss and norm, so all skip or all step
        out = reduce_metrics(out, self.device)
        grad_norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
        return self._apply_update(out, float(grad_norm))

    def _budget_groups(self, batch: TrainBatch) -> list[list[int]] | None:
        """This rank's token-budget groups, split until every rank has as many as the one with the most
        (collective: each micro-batch's forward and backward gather and scatter over the ranks)."""
        groups = super()._budget_groups(batch)
        if groups is None:
            return None
        return split_groups(groups, max_over_ranks(len(groups), self.device))

    def sum_over_ranks(self, values: list[float]) -> list[float]:
        summed = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(summed)
        return summed.tolist()

    # ------------------------------------------------------------------ weights
    def iter_weights(self, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        """Gathered weights in HF names, one bucket at a time (collective): at most one bucket of full
        tensors exists besides the shards."""
        # LoRA: merged in fp32 from the gathered base and adapters, then cast to model.dtype
        dtype = torch.float32 if self.lora else self.compute_dtype
        full = ((name, _gather(t, dtype)) for name, t in self.model.state_dict().items())
        if self.lora:
            full = ((name, self._out(t)) for name, t in merged_weights(full, self.lora_scales))
        for bucket in bucket_by_bytes(full, bucket_bytes):
            yield dict(bucket)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every weight gathered (collective); what rollout engines load."""
        return {name: tensor for bucket in self.iter_weights(64 << 20) for name, tensor in bucket.items()}

    def publish_weights(self) -> dict[str, torch.Tensor]:
        """LoRA adapter sync: the adapter payload, gathered (collective); else :meth:`state_dict`."""
        if not (self.lora and self.engine_adapters):
            return self.state_dict()
        return dict(
            self._adapter_payload((n, _gather(t, torch.float32)) for n, t in self.model.state_dict().items())
        )

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Full HF-named weights (an adapter payload merged first); each rank keeps its shard."""
        self.base_version += 1
        set_model_state_dict(
            self.model,
            peft_names(merged_payload(state_dict), self.lora_scales),
            options=StateDictOptions(full_state_dict=True, strict=False),
        )
        zero_adapters(self.model)

    def _adapter_weights(self) -> dict[str, torch.Tensor]:
        """The adapters gathered in fp32 (collective)."""
        return {k: _gather(v, torch.float32) for k, v in self.model.state_dict().items() if is_adapter(k)}

    def _save_adapter(self, path: str, adapters: dict[str, torch.Tensor], base_model: str) -> None:
        if self.rank == 0:
            super()._save_adapter(path, adapters, base_model)

    # ------------------------------------------------------------------ checkpoints
    def _rank_file(self, path: str) -> Path:
        return Path(path) / f"fsdp_rank{self.rank:05d}.pt"

    def set_warm_start(self, active: bool) -> None:
        """Adapters only, from the start (``check_lora_config`` refuses ``full_warm_start`` with FSDP: FSDP2
        fixes which parameters take gradients when it first gathers them)."""

    def _dcp_options(self) -> StateDictOptions:
        """LoRA: checkpoints hold the adapters (the trainable parameters) only; the base is ``model_path``."""
        return StateDictOptions(ignore_frozen_params=bool(self.lora), strict=not self.lora)

    def save_checkpoint(self, path: str) -> None:
        """Sharded model + optimizer via ``torch.distributed.checkpoint``; scheduler and RNG per rank.

        A fresh optimizer (no step taken yet) is left out: DCP would initialise its state with a zero-lr
        step, which advances Adam's step count and changes the run that continues after the save.
        """
        os.makedirs(path, exist_ok=True)
        if self.lora:  # a copy in peft's format for users; resume reads the sharded state
            self._save_adapter(f"{path}/adapter", self._adapter_weights(), self.model_path)
        with_optimizer = self.optimizer is not None and bool(self.optimizer.state)
        if with_optimizer:
            model_state, optim_state = get_state_dict(self.model, self.optimizer, options=self._dcp_options())
            state = {"model": model_state, "optimizer": optim_state}
        else:
            state = {"model": get_model_state_dict(self.model, options=self._dcp_options())}
        dcp.save(state, checkpoint_id=str(Path(path) / "dcp"))
        torch.save(
            {
                "with_optimizer": with_optimizer,
                "scheduler": self.scheduler.state_dict() if self.scheduler else None,
                "rng": rng_state(),
                "ranks": self.ranks,
                "lora": bool(self.lora),
            },
            self._rank_file(path),
        )

    def load_checkpoint(self, path: str) -> None:
        from relax_core.errors import RelaxUserError

        file = self._rank_file(path)
        if not file.is_file():
            raise RelaxUserError(f"{path} holds no FSDP checkpoint for rank {self.rank} ({file.name})")
        meta = torch.load(file, weights_only=False)
        if meta["ranks"] != self.ranks:
            raise RelaxUserError(
                f"checkpoint {path} was saved by {meta['ranks']} FSDP ranks; this run has {self.ranks}: "
                f"resume with trainer.dp_size={meta['ranks']}"
            )
        if meta.get("lora", False) != bool(self.lora):
            saved = "LoRA adapters" if meta.get("lora") else "full weights"
            raise RelaxUserError(
                f"checkpoint {path} holds {saved}; this run has trainer.lora.rank="
                f"{self.lora.rank if self.lora else 0}: resume with the trainer.lora settings it was saved with"
            )
        options = self._dcp_options()
        if meta["with_optimizer"] and self.optimizer is not None:
            model_state, optim_state = get_state_dict(self.model, self.optimizer, options=options)
            state = {"model": model_state, "optimizer": optim_state}
            dcp.load(state, checkpoint_id=str(Path(path) / "dcp"))
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
                options=options,
            )
        else:
            state = {"model": get_model_state_dict(self.model, options=options)}
            dcp.load(state, checkpoint_id=str(Path(path) / "dcp"))
            set_model_state_dict(self.model, state["model"], options=options)
        if self.scheduler is not None and meta["scheduler"] is not None:
            self.scheduler.load_state_dict(meta["scheduler"])
        set_rng_state(meta["rng"])

    def export_hf(self, path: str) -> None:
        """Every rank gathers; rank 0 writes config, safetensors and tokenizer (LoRA: and ``<path>/adapter``
        in peft's format; FSDP never trains the base, so the adapters apply to ``model_path``)."""
        weights = self.state_dict()
        adapters = self._adapter_weights() if self.lora else {}
        if self.rank != 0:
            return
        self._save_pretrained(path, weights)
        load_tokenizer(self.model_path).save_pretrained(path)
        if self.lora:
            self._save_adapter(f"{path}/adapter", adapters, self.model_path)


def _gather(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The full tensor of a shard (collective), on the CPU; floating point in ``dtype`` (``model.dtype``)."""
    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.clone()
    return full.detach().to("cpu", dtype if full.is_floating_point() else full.dtype)


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of an HF model: the members of every ``*.layers`` module list."""
    return [
        block
        for name, blocks in model.named_modules()
        if name.endswith("layers") and isinstance(blocks, torch.nn.ModuleList)
        for block in blocks
    ]
