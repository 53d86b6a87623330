"""Training backend on a plain HF model with AdamW, on the device of its role (CPU, or one GPU)."""

from __future__ import annotations

import contextlib
import copy
import os
import random
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from relax_core.algorithms.logprobs import response_logprobs_and_entropy, token_logprobs_and_entropy
from relax_core.backends.base import (
    SKIPPED_STEPS,
    LossFn,
    TrainingBackend,
    accumulate_gradients,
    batch_to_device,
    pack_rows,
    pad_to_width,
    row_lengths,
    scatter_rows,
    token_budget_groups,
    update_is_finite,
)
from relax_core.backends.schedule import lr_multiplier
from relax_core.backends.shared_prompts import prompt_groups, shared_prompt_logits
from relax_core.data.multimodal import multimodal_model_inputs
from relax_core.runtime.placement import role_device
from relax_core.samples import TrainBatch
from relax_models.errors import RelaxUserError
from relax_models.loader import DTYPES, load_causal_lm, load_tokenizer
from relax_models.lora import (
    adapter_payload,
    apply_lora,
    base_weights,
    is_adapter,
    load_adapter,
    lora_scales,
    merged_payload,
    merged_weights,
    peft_names,
    save_adapter,
    zero_adapters,
)
from relax_models.routing_replay import RoutingReplay, replay_routing

if TYPE_CHECKING:
    from peft import LoraConfig

    from relax_core.config.schema import ModelConfig, TrainerConfig

# families whose text forward takes packed rows (position ids restarting per row, no attention mask)
PACKED_FAMILIES = ("qwen3", "qwen3_moe")


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


class TorchBackend(TrainingBackend):
    """One HF model; ``trainable=False`` gives a frozen scorer (Reference, Teacher).

    ``model.dtype`` is the dtype the model computes in. A trainable model keeps its parameters, gradients
    and AdamW state in fp32 (master weights: at lr 1e-6 a bf16 parameter would round most updates away)
    and runs its forward in ``model.dtype`` (:meth:`_cast_forward`); a frozen scorer holds its weights in
    ``model.dtype``. Weights leave the backend (:meth:`state_dict`, export) in ``model.dtype``, the dtype
    the rollout engines load.

    ``trainer.lora.rank`` (a trainable policy only; not the Critic, whose trainer config has no ``lora``):
    peft's low-rank adapters on the ``target_modules`` layers are all that trains and all the optimizer holds,
    at ``trainer.lora.lr_scale`` times the phase's learning rate; weights leave the backend merged
    (W + B·A·alpha/rank) under the base model's names and shapes; checkpoints hold the adapters in peft's
    format (``adapter/``) beside their optimizer state, the scheduler and RNG (the frozen base is the run's
    ``model_path``, or, after a ``full_warm_start``, kept in the checkpoint too).
    """

    def __init__(
        self,
        model_path: str,
        trainer_cfg: TrainerConfig,
        model_cfg: ModelConfig,
        temperature: float = 1.0,
        trainable: bool = True,
    ):
        self.model_path = model_path
        self.temperature = temperature
        self.family = model_cfg.family
        if model_cfg.dtype not in DTYPES:
            raise RelaxUserError(f"model.dtype={model_cfg.dtype!r} is not one of {sorted(DTYPES)}")
        self.compute_dtype = DTYPES[model_cfg.dtype]
        self.trainable = trainable
        # what _build_model loads: a trainable model's parameters in fp32 (read straight from the checkpoint)
        self.model_cfg = model_cfg
        if trainable:
            self.model_cfg = copy.copy(model_cfg)  # a dataclass or a namespace (the teacher's pretraining)
            self.model_cfg.dtype = "float32"
        self.device = role_device()
        self.model = self._build_model(model_path, self.model_cfg, self._load_device())
        self.model.train(trainable)
        self.model.requires_grad_(trainable)
        lora = getattr(trainer_cfg, "lora", None) if trainable else None
        self.lora = lora if lora is not None and lora.rank else None
        self.lora_config = self._apply_lora(self.model)
        self.lora_scales = lora_scales(self.model)
        # LoRA with full_warm_start: the base was trained by the warm-start, so checkpoints must keep it
        self.base_trained = False
        # LoRA adapter sync (set by the Actor, relax_core.engines.adapter_sync_rank): published versions are
        # adapter payloads; base_version moves whenever the base may have changed, so engines reload it then
        self.engine_adapters = False
        self.base_version = 0
        if trainable and model_cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
            if self.lora:  # frozen embeddings: checkpointed blocks need an input that requires grad
                self.model.enable_input_require_grads()
        self.trainer_cfg = trainer_cfg
        # the prompt pass hands its KV cache to the response pass; HF turns the cache off under checkpointing
        self.share_prompts = trainer_cfg.share_prompts and not (
            trainable and model_cfg.gradient_checkpointing
        )
        self.optimizer = self.scheduler = None
        # algorithm.routing_replay (set by the Actor): forwards replay the batch's recorded MoE routing
        self.routing_replay = False
        self._replay: RoutingReplay | None = None
        self._shard()
        self._cast_forward()
        if trainable:
            self.reset_optimizer(trainer_cfg.lr)

    def _build_model(self, model_path: str, model_cfg: ModelConfig, device: torch.device) -> torch.nn.Module:
        """The model this backend trains or scores with (a value-head model for the Critic), on ``device``
        (``meta``: the architecture without weights)."""
        return load_causal_lm(
            model_path,
            model_cfg.dtype,
            model_cfg.attn_implementation,
            family=model_cfg.family,
            device=device,
        )

    def _apply_lora(self, model: torch.nn.Module) -> LoraConfig | None:
        """peft adapters on ``model`` when LoRA is on (their peft config; None otherwise)."""
        if not self.lora:
            return None
        c = self.lora
        return apply_lora(model, c.rank, c.alpha, c.dropout, list(c.target_modules))

    def set_warm_start(self, active: bool) -> None:
        """LoRA with ``full_warm_start``: the base trains during the warm-start (the adapters, B = 0, add
        nothing meanwhile), the adapters alone after it."""
        if not (self.lora and self.lora.full_warm_start):
            return
        self.base_version += 1
        self.model.zero_grad(set_to_none=True)  # a frozen parameter's last gradient would enter clipping
        for name, p in self.model.named_parameters():
            p.requires_grad_(is_adapter(name) != active)
        self.base_trained = self.base_trained or not active

    def _load_device(self) -> torch.device:
        """Where the model is built: the role's device."""
        return self.device

    def _shard(self) -> None:
        """Hook for sharded subclasses (FSDP): runs once the model is loaded, before the optimizer."""

    def _cast_forward(self) -> None:
        """fp32 parameters computing in a lower ``model.dtype``: the model's forward runs under autocast (the
        backward follows the forward's dtypes; gradients land in fp32 on the fp32 parameters)."""
        if self.trainable and self.compute_dtype != torch.float32:
            autocast = torch.autocast(self.device.type, dtype=self.compute_dtype)
            self.model.forward = autocast(self.model.forward)

    def reset_optimizer(self, lr: float) -> None:
        t = self.trainer_cfg
        # foreach: one multi-tensor kernel per update term instead of ~10 ops per parameter (torch picks the
        # per-parameter loop on CPU); same arithmetic, bit-identical weights
        # LoRA: the adapters alone (the frozen base holds no optimizer state), at lr_scale x lr: adapters move
        # the policy less per step than full fine-tuning at the same lr
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.lora and all(is_adapter(n) for n, p in self.model.named_parameters() if p.requires_grad):
            lr *= self.lora.lr_scale
        self.optimizer = torch.optim.AdamW(
            params, lr=lr, weight_decay=t.weight_decay, betas=tuple(t.betas), foreach=True
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_multiplier(t))

    def offload(self) -> None:
        """Parameters and optimizer state to the CPU, gradients dropped (the next step zeroes them anyway);
        nothing to do for a model that lives on the CPU."""
        if self.device.type != "cpu":
            self.model.zero_grad(set_to_none=True)
            self._move_to(torch.device("cpu"))
            torch.cuda.empty_cache()

    def onload(self) -> None:
        if self.device.type != "cpu":
            self._move_to(self.device)

    def _move_to(self, device: torch.device) -> None:
        self.model.to(device)
        for state in self.optimizer.state.values() if self.optimizer else ():
            for key, value in state.items():
                # Adam's scalar step count stays on the CPU (where a non-capturable optimizer keeps it)
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    state[key] = value.to(device)

    @contextlib.contextmanager
    def _replaying(self):
        """With ``routing_replay``: the routers replay each micro-batch's recorded experts for the whole
        pass, so a checkpointed backward reruns its forward with the same routing."""
        if not self.routing_replay:
            yield
            return
        with replay_routing(self.model) as replay:
            self._replay = replay
            try:
                yield
            finally:
                self._replay = None

    def _route(self, routing: torch.Tensor | None) -> None:
        """The ``[tokens, layers, top_k]`` experts the next forward replays (None: its own routing)."""
        if self._replay is not None:
            self._replay.indices = routing

    def _logprobs_entropy(self, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        # multimodal rows: pixel/audio tensors as forward kwargs; the model derives its M-RoPE positions
        # from input_ids + grids itself, so no position_ids are passed (right padding is fine)
        batch = batch_to_device(batch, self.device)
        replay = self._replay is not None and batch.routing is not None
        # the shared-prompt passes split each row in two forwards; replay takes the one padded forward
        groups = prompt_groups(batch) if self.share_prompts and not replay else None
        self._route(batch.routing.flatten(0, 1) if replay else None)
        if groups is not None:
            logits = shared_prompt_logits(self.model, batch, groups)
            logprobs, entropy = response_logprobs_and_entropy(logits, batch, self.temperature)
        else:
            input_ids, mm = multimodal_model_inputs(self.family, self.model, batch)
            logits = self.model(input_ids=input_ids, attention_mask=batch.attention_mask, **mm).logits
            logprobs, entropy = token_logprobs_and_entropy(logits, batch, self.temperature)
        return logprobs.cpu(), entropy.cpu()  # the loss runs next to the batch's masks (CPU)

    def _packed_logprobs_entropy(self, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_logprobs_entropy` with the rows packed end to end, no padding (:func:`pack_rows`), and
        logits only at the response positions; families without packed position ids (the multimodal ones
        derive M-RoPE positions from padded rows) take the padded forward."""
        if self.family not in PACKED_FAMILIES or any(mm is not None for mm in batch.multimodal_inputs):
            return self._logprobs_entropy(batch)
        batch = batch_to_device(batch, self.device)
        input_ids, position_ids, keep = pack_rows(batch)
        replay = self._replay is not None and batch.routing is not None
        self._route(batch.routing[batch.attention_mask.bool()] if replay else None)  # packed like the ids
        # no attention mask and no cache: HF reads the row boundaries from the position ids
        out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=keep)
        logits = out.logits.view(*batch.loss_mask.shape, -1)
        logprobs, entropy = response_logprobs_and_entropy(logits, batch, self.temperature)
        return logprobs.cpu(), entropy.cpu()

    @torch.no_grad()
    def forward_logprobs(self, batch: TrainBatch, micro_batch_size: int = 64) -> torch.Tensor:
        with self._replaying():
            return self._forward_logprobs(batch, micro_batch_size)

    def _forward_logprobs(self, batch: TrainBatch, micro_batch_size: int) -> torch.Tensor:
        groups = self._budget_groups(batch)
        if groups is not None:
            parts = [self._packed_logprobs_entropy(batch.select(rows))[0] for rows in groups]
            return scatter_rows(parts, groups, batch.loss_mask.shape[1])
        parts = [self._logprobs_entropy(mb)[0] for mb in batch.micro_batches(micro_batch_size)]
        return pad_to_width(parts, batch.loss_mask.shape[1])

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, micro_batch_size: int) -> dict[str, float]:
        assert self.optimizer is not None, "train_step on a frozen backend"
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        groups = self._budget_groups(batch)
        with self._replaying():
            out = accumulate_gradients(batch, self._train_logprobs, loss_fn, micro_batch_size, groups=groups)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.trainer_cfg.grad_clip)
        return self._apply_update(out, float(grad_norm))

    @property
    def _train_logprobs(self) -> Callable[[TrainBatch], tuple[torch.Tensor, torch.Tensor]]:
        """The training forward: packed rows with a token budget (a bus stream's row-count micro-batches
        too), else padded ones."""
        packed = getattr(self.trainer_cfg, "max_tokens_per_micro_batch", None)
        return self._packed_logprobs_entropy if packed else self._logprobs_entropy

    def _budget_groups(self, batch: TrainBatch) -> list[list[int]] | None:
        """With ``trainer.max_tokens_per_micro_batch``: the packed micro-batches' rows of ``batch`` (None
        without it, or for a bus stream, which forms its own micro-batches)."""
        max_tokens = getattr(self.trainer_cfg, "max_tokens_per_micro_batch", None)
        if not max_tokens or not isinstance(batch, TrainBatch):
            return None
        return token_budget_groups(row_lengths(batch), max_tokens)

    def _apply_update(self, out: dict[str, float], grad_norm: float) -> dict[str, float]:
        """The optimizer and scheduler step, or, for a non-finite loss or gradient norm, none: the
        gradients are dropped and the skip counted (``out`` holds the batch's loss)."""
        skipped = not update_is_finite(out["loss"], grad_norm)
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            self.scheduler.step()
        out.update(grad_norm=grad_norm, lr=self.scheduler.get_last_lr()[0])
        out[SKIPPED_STEPS] = float(skipped)
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights in ``model.dtype`` on the CPU (fp32 master weights rounded to what engines load);
        LoRA: merged into the base weights, under the base model's names."""
        weights = self.model.state_dict().items()
        if self.lora:
            weights = merged_weights(weights, self.lora_scales)
        return {k: self._out(v) for k, v in weights}

    def publish_weights(self) -> dict[str, torch.Tensor]:
        """:meth:`state_dict`, or with LoRA adapter sync the adapter payload: the base and the adapters
        unmerged, in ``model.dtype``, with the base's version and alpha / rank."""
        if not (self.lora and self.engine_adapters):
            return self.state_dict()
        return dict(self._adapter_payload(self.model.state_dict().items()))

    def _adapter_payload(
        self, named: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        if any(p.requires_grad for n, p in self.model.named_parameters() if not is_adapter(n)):
            self.base_version += 1  # the base trains (a full warm-start): each version may carry a new one
        weights = ((k, self._out(v)) for k, v in named)
        return adapter_payload(weights, self.lora_scales, self.base_version)

    def _out(self, tensor: torch.Tensor) -> torch.Tensor:
        """A CPU copy of ``tensor``, in ``model.dtype`` if it is floating point."""
        dtype = self.compute_dtype if tensor.is_floating_point() else tensor.dtype
        return tensor.detach().to("cpu", dtype, copy=True)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """LoRA: the weights become the base and the adapters add nothing, so the model computes exactly
        ``state_dict`` (ActorFwd follows the policy's merged weights; an adapter payload is merged first)."""
        state_dict = merged_payload(state_dict)
        self.base_version += 1
        self.model.load_state_dict(peft_names(state_dict, self.lora_scales), strict=False)
        zero_adapters(self.model)

    def _adapter_weights(self) -> dict[str, torch.Tensor]:
        """The adapters as full fp32 tensors on the CPU, under the model's state-dict names."""
        return {
            k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items() if is_adapter(k)
        }

    def _save_adapter(self, path: str, adapters: dict[str, torch.Tensor], base_model: str) -> None:
        save_adapter(path, self.model, adapters, self.lora_config, base_model)

    def save_checkpoint(self, path: str) -> None:
        """LoRA: the adapters in peft's format (``adapter/``), the model state only when the warm-start
        trained the base."""
        os.makedirs(path, exist_ok=True)
        if self.lora:
            self._save_adapter(f"{path}/adapter", self._adapter_weights(), self.model_path)
        full = not self.lora or self.base_trained
        torch.save(
            {
                "model": self.model.state_dict() if full else {},
                "lora": bool(self.lora),
                "base_trained": self.base_trained,
                "optimizer": self.optimizer.state_dict() if self.optimizer else None,
                "scheduler": self.scheduler.state_dict() if self.scheduler else None,
                "rng": rng_state(),
            },
            Path(path) / "backend.pt",
        )

    def load_checkpoint(self, path: str) -> None:
        state = torch.load(Path(path) / "backend.pt", weights_only=False)
        if state.get("lora", False) != bool(self.lora):
            saved = "LoRA adapters" if state.get("lora") else "full weights"
            rank = self.lora.rank if self.lora else 0
            raise RelaxUserError(
                f"checkpoint {path} holds {saved}; this run has trainer.lora.rank={rank}: "
                "resume with the trainer.lora settings the checkpoint was saved with"
            )
        self.base_trained = state.get("base_trained", False)
        self.base_version += 1
        if not self.lora or self.base_trained:
            self.model.load_state_dict(state["model"])
        if self.lora:
            mismatched = load_adapter(Path(path) / "adapter", self.model)
            if mismatched:
                raise RelaxUserError(
                    f"checkpoint {path}'s adapters do not match this run's ({mismatched[:3]}): resume with the "
                    "trainer.lora.target_modules the checkpoint was saved with"
                )
        if self.optimizer and state["optimizer"]:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])

    def export_hf(self, path: str) -> None:
        """The merged model; LoRA: also the adapters in peft's format in ``<path>/adapter`` (their base: the
        run's ``model_path``, or the warm-start-trained base, written to ``<path>/adapter/base``)."""
        self._save_pretrained(path, self.state_dict())
        load_tokenizer(self.model_path).save_pretrained(path)
        if self.lora:
            base = self.model_path
            if self.base_trained:
                base = str(Path(path).resolve() / "adapter" / "base")
                weights = base_weights(self.model.state_dict().items(), self.lora_scales)
                self._save_pretrained(base, {k: self._out(v) for k, v in weights})
                load_tokenizer(self.model_path).save_pretrained(base)
            self._save_adapter(f"{path}/adapter", self._adapter_weights(), base)

    def _save_pretrained(self, path: str, weights: dict[str, torch.Tensor]) -> None:
        """Config and safetensors of ``weights`` (in ``model.dtype``): the config records that dtype, not
        the fp32 of the master weights, so ``dtype="auto"`` loads the folder as it was trained."""
        self.model.save_pretrained(path, state_dict=weights)
        self.model.config.dtype = str(self.compute_dtype).removeprefix("torch.")
        self.model.config.save_pretrained(path)
