"""Training backend on megatron-core (tensor / expert parallel Qwen3 and Qwen3-MoE).

One instance runs in each training process; the processes of one model replica form megatron's
tensor/expert groups over the default ``torch.distributed`` group (started here from ``RANK``,
``WORLD_SIZE`` and ``relax_core.runtime.placement.join_rendezvous`` when not yet running). Every method below that
touches weights is *collective*: all ranks call it in step with the whole batch; each data-parallel replica
(``trainer.dp_size``, or the replicas an expert grid adds) trains on its own slice of it, and the
replicas' gradients are averaged with each scaled by their count, so N replicas take one replica's step.

Log-probs come from :func:`relax_core.algorithms.logprobs.token_logprobs_and_entropy` on the full-vocab
logits, so this backend optimises exactly the objective of the torch backend.

A trainable model is wrapped in megatron's ``DistributedDataParallel`` (fp32 gradient buffers) and its
gradients are reduced by megatron's ``finalize_model_grads`` on every device (gloo on CPU). The optimizer:
GPU, megatron's distributed optimizer (its state sharded over data-parallel ranks); CPU, a plain
``torch.optim.AdamW`` on the reduced gradients with a tensor-parallel-aware global-norm clip, because
megatron-core 0.16.1's optimizers allocate CUDA tensors unconditionally. A bf16 model (``model.dtype``) keeps
fp32 main params and Adam state on both: megatron's optimizer on GPU, fp32 copies the AdamW steps on CPU. Pipeline and context parallelism
are validated but not run by this backend yet.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relax_core.algorithms.logprobs import token_logprobs_and_entropy
from relax_core.backends.base import (
    SKIPPED_STEPS,
    LossFn,
    TrainingBackend,
    accumulate_gradients,
    batch_to_device,
    max_over_ranks,
    pad_to_width,
    rank_slice,
    reduce_metrics,
    update_is_finite,
)
from relax_core.backends.schedule import lr_multiplier
from relax_core.backends.torch_backend import rng_state, set_rng_state
from relax_core.errors import RelaxUserError
from relax_core.runtime.placement import join_rendezvous
from relax_core.samples import TrainBatch
from relax_models.megatron.bridge import (
    Qwen3Bridge,
    Ranks,
    SafetensorsCheckpoint,
    bucket_by_bytes,
    module_layout,
    unfuse_experts,
)
from relax_models.megatron.cpu_shim import cuda_available, init_process_group
from relax_models.megatron.model import (
    ParallelSizes,
    arch_from_hf_config,
    build_gpt_model,
    forward_logits,
    initialize_parallel,
    is_expert_param,
    main_grads_to_grads,
    uses_transformer_engine,
)

log = logging.getLogger(__name__)
# megatron-core announces its fallbacks once per process and module; on CPU they are expected
for _message in (".*Transformer Engine.*", ".*Apex is not installed.*", ".*full scope is deprecated.*"):
    warnings.filterwarnings("ignore", message=_message, category=UserWarning)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class MegatronBackend(TrainingBackend):
    """A megatron-core ``GPTModel`` shard loaded from an HF folder; speaks HF names at its boundary.

    ``parallel`` (or ``trainer_cfg.megatron`` when absent) holds ``tensor``, ``pipeline``, ``context``,
    ``expert`` and optional ``expert_tensor``. ``trainable=False`` gives a frozen scorer (Reference).
    """

    def __init__(
        self,
        model_path: str,
        trainer_cfg: Any,
        model_cfg: Any,
        seed: int,
        *,
        parallel: Any = None,
        temperature: float = 1.0,
        trainable: bool = True,
    ):
        from transformers import AutoConfig

        self.model_path = model_path
        self.temperature = temperature
        self.trainable = trainable
        dtype_name = getattr(model_cfg, "dtype", "float32")
        if dtype_name not in DTYPES:
            raise RelaxUserError(f"model.dtype={dtype_name!r} is not one of {sorted(DTYPES)}")
        self.dtype = DTYPES[dtype_name]
        self.hf_config = AutoConfig.from_pretrained(model_path)
        self.arch = arch_from_hf_config(self.hf_config)
        self.sizes = ParallelSizes.from_config(
            parallel if parallel is not None else getattr(trainer_cfg, "megatron", None)
        )
        if self.sizes.pipeline > 1 or self.sizes.context > 1:
            raise RelaxUserError(
                "trainer.megatron.pipeline>1 / context>1 are not run by the megatron backend yet; "
                "use tensor and expert parallelism (pipeline=1, context=1)"
            )
        join_rendezvous()  # MASTER_ADDR/PORT of the group, wherever Ray put its ranks
        init_process_group()
        self.dp_size = initialize_parallel(self.arch, self.sizes, seed)
        torch.manual_seed(seed)
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if cuda_available() else torch.device("cpu")
        )
        self.ranks = Ranks.from_parallel_state()
        self.bridge = Qwen3Bridge(self.arch, self.sizes, fused_norms=uses_transformer_engine())
        self.model = build_gpt_model(self.arch, self.sizes, self.dtype)
        self.bridge.load_into(self.model, _open_checkpoint(model_path), self.ranks)
        self._set_training(trainable)
        self.model.requires_grad_(trainable)
        self.trainer_cfg = trainer_cfg
        self.grad_clip = float(trainer_cfg.grad_clip)
        self.optimizer: Any = None
        self.scheduler: Any = None
        # CPU, bf16/fp16 model: the fp32 main params the AdamW steps (one per model parameter)
        self._main: list[torch.Tensor] | None = None
        self._ddp: Any = None
        if trainable:
            self._ddp = self._wrap_ddp()
            self.reset_optimizer(trainer_cfg.lr)

    def _wrap_ddp(self) -> Any:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        return DistributedDataParallel(
            config=self.model.config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                use_distributed_optimizer=cuda_available(),
            ),
            module=self.model,
        )

    def _set_training(self, training: bool) -> None:
        """On CPU the module always runs in eval mode: our configs have no dropout and no MoE aux loss,
        so both modes compute the same function and gradients, and eval mode skips megatron's
        "MoE + TP needs sequence parallel" training guard that torch norms cannot satisfy."""
        self.model.train(training and cuda_available())

    # ------------------------------------------------------------------ optimiser
    def reset_optimizer(self, lr: float) -> None:
        """Fresh optimizer (and warm-up schedule) state at learning rate ``lr``."""
        t = self.trainer_cfg
        self._base_lr = float(lr)
        self._multiplier = lr_multiplier(t)  # the torch backend's schedule (warm-up, constant/cosine)
        self._steps = 0
        if cuda_available():  # GPU: megatron DDP + distributed optimizer
            self._build_megatron_optimizer(lr)
            return
        self.optimizer = torch.optim.AdamW(
            self._main_params(), lr=lr, weight_decay=t.weight_decay, betas=tuple(t.betas)
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._multiplier)

    def _main_params(self) -> list[torch.Tensor]:
        """What the CPU AdamW steps: an fp32 model's own parameters, or, for a bf16/fp16 model, fp32 main
        params the model's weights follow after each step, as megatron's bf16 optimizer keeps them on GPU
        (a bf16 parameter would round most lr-1e-6 updates away). They outlive an optimizer reset."""
        params = list(self.model.parameters())
        if self.dtype == torch.float32:
            return params
        if self._main is None:
            self._main = [p.detach().float() for p in params]
        return self._main

    def _main_to_model(self) -> None:
        """The model's (bf16/fp16) weights from the fp32 main params, after a step."""
        with torch.no_grad():
            for p, main in zip(self.model.parameters(), self._main or ()):
                p.copy_(main)

    def _model_to_main(self) -> None:
        """The fp32 main params from weights loaded into the model."""
        with torch.no_grad():
            for p, main in zip(self.model.parameters(), self._main or ()):
                main.copy_(p)

    def _build_megatron_optimizer(self, lr: float) -> None:  # pragma: no cover - needs CUDA
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        t = self.trainer_cfg
        betas = tuple(t.betas)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=lr,
                weight_decay=t.weight_decay,
                adam_beta1=betas[0],
                adam_beta2=betas[1],
                clip_grad=self.grad_clip,
                bf16=self.dtype == torch.bfloat16,
                fp16=self.dtype == torch.float16,
                params_dtype=self.dtype,
                use_distributed_optimizer=True,
            ),
            [self._ddp],
        )

    def _lr(self) -> float:
        return self._base_lr * self._multiplier(self._steps)

    # ------------------------------------------------------------------ forward / train
    def _logprobs_entropy(self, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        batch = batch_to_device(batch, self.device)
        module = self._ddp if self._ddp is not None else self.model
        input_ids, length = batch.input_ids, batch.input_ids.shape[1]
        if self.arch.num_experts and self.dp_size > 1:
            # the MoE all-gather dispatcher needs equal token counts on every rank, but data-parallel
            # replicas hold different slices: right-pad to the widest (causal, so logits are unchanged)
            width = max_over_ranks(length, self.device)
            input_ids = torch.nn.functional.pad(input_ids, (0, width - length))
        logits = forward_logits(module, input_ids, self.arch.vocab_size)[:, :length]
        logprobs, entropy = token_logprobs_and_entropy(logits, batch, self.temperature)
        return logprobs.cpu(), entropy.cpu()

    @torch.no_grad()
    def forward_logprobs(self, batch: TrainBatch, micro_batch_size: int = 64) -> torch.Tensor:
        self._set_training(False)
        try:
            parts = [self._logprobs_entropy(mb)[0] for mb in batch.micro_batches(micro_batch_size)]
        finally:
            self._set_training(self.trainable)
        return pad_to_width(parts, batch.loss_mask.shape[1])

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, micro_batch_size: int) -> dict[str, float]:
        if self.optimizer is None:
            raise RuntimeError("train_step on a frozen backend (trainable=False)")
        from megatron.core.distributed import finalize_model_grads

        self._set_training(True)
        self._ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        out = self._accumulate(batch, loss_fn, micro_batch_size)
        finalize_model_grads([self._ddp])  # data-parallel all-reduce, q/k-norm sum over TP
        if self._megatron_optimizer():  # pragma: no cover - needs CUDA
            for group in self.optimizer.param_groups:
                group["lr"] = self._lr()
            # the optimizer clips inside step(), so only the (reduced) loss can be checked before it; it
            # reports an update it skipped itself (inf/NaN gradients) as not successful
            applied, grad_norm = False, float("nan")
            if update_is_finite(out["loss"], 0.0):
                applied, grad_norm, _ = self.optimizer.step()
                grad_norm = float(grad_norm if grad_norm is not None else 0.0)
            skipped = not (applied and update_is_finite(out["loss"], grad_norm))
            if skipped:
                self._ddp.zero_grad_buffer()
                self.optimizer.zero_grad()
            else:
                self._steps += 1
            out.update(grad_norm=grad_norm, lr=self._lr())
            out[SKIPPED_STEPS] = float(skipped)
            return out
        main_grads_to_grads(self.model, self._main)
        grad_norm = self._clip_grads()
        skipped = not update_is_finite(out["loss"], grad_norm)
        if skipped:  # the norm is global (TP/EP-reduced) and the loss DP-reduced: every rank skips alike
            self._ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
        else:
            self.optimizer.step()
            self._main_to_model()
            self.scheduler.step()
            self._steps += 1
        out.update(grad_norm=grad_norm, lr=self.scheduler.get_last_lr()[0])
        out[SKIPPED_STEPS] = float(skipped)
        return out

    def _accumulate(self, batch: TrainBatch, loss_fn: LossFn, micro_batch_size: int) -> dict[str, float]:
        """Backward over this data-parallel replica's slice of ``batch``.

        ``loss_fn`` weighs micro-batches against the whole batch, and the gradient reduction averages
        over replicas, so each replica scales its gradient by their count: the step equals one replica's
        step on the whole batch. Metrics are reduced over the replicas (loss summed, the rest averaged).
        """
        if self.dp_size == 1:
            return accumulate_gradients(batch, self._logprobs_entropy, loss_fn, micro_batch_size)
        from megatron.core import parallel_state as ps

        local = rank_slice(batch, ps.get_data_parallel_rank(), self.dp_size)
        out = accumulate_gradients(local, self._logprobs_entropy, loss_fn, micro_batch_size, self.dp_size)
        return reduce_metrics(out, self.device, ps.get_data_parallel_group())

    # mode=async streams a batch (relax_core.databus.stages.MicroStream): the ranks of one replica read the
    # same rows, the replicas their own
    def data_parallel_rank(self, process_rank: int) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank()

    def sum_over_ranks(self, values: list[float]) -> list[float]:
        from megatron.core import parallel_state as ps

        summed = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(summed, group=ps.get_data_parallel_group())
        return summed.tolist()

    def any_over_ranks(self, flag: bool) -> bool:
        """Over the whole world: every rank of a replica is in its tensor/expert collectives."""
        value = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(value)
        return bool(value.item())

    def scale_gradients(self, factor: float) -> None:
        """Gradients sit in the DDP's ``main_grad`` buffers until :meth:`train_step` finalizes them."""
        for p in self.model.parameters():
            grad = getattr(p, "main_grad", None)
            if grad is not None:
                grad.mul_(factor)

    def _named_grads(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The gradients the CPU AdamW steps on (the main params'), by model parameter name."""
        named = list(self.model.named_parameters())
        for (name, _), p in zip(named, self._main or [p for _, p in named]):
            if p.grad is not None:
                yield name, p.grad

    def _clip_grads(self) -> float:
        """Clip by the norm of the *whole* model's gradient, counting every shard once."""
        from megatron.core import parallel_state as ps

        # replicated, TP-sharded, expert; on the gradients' device, which the TP/EP groups serve
        sq = torch.zeros(3, dtype=torch.float64, device=self.device)
        for name, grad in self._named_grads():
            value = grad.detach().double().pow(2).sum()
            if is_expert_param(name):
                sq[2] += value
            elif self.bridge.is_sharded(name, self.ranks):
                sq[1] += value
            else:
                sq[0] += value
        tp_part, ep_part = sq[1:2].clone(), sq[2:3].clone()
        if self.sizes.tensor > 1:
            dist.all_reduce(tp_part, group=ps.get_tensor_model_parallel_group())
        if self.sizes.etp * self.sizes.expert > 1:
            dist.all_reduce(ep_part, group=ps.get_expert_tensor_and_model_parallel_group())
        total = float((sq[0] + tp_part + ep_part).sqrt())
        if self.grad_clip > 0 and total > self.grad_clip:
            scale = self.grad_clip / (total + 1e-6)
            for _, grad in self._named_grads():
                grad.mul_(scale)
        return total

    # ------------------------------------------------------------------ weights
    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors under HF *checkpoint* names (per-expert), one at a time (collective)."""
        return self.bridge.iter_hf_weights(self.model, self.ranks)

    def hf_weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Checkpoint-named weights in lists of at most ``bucket_bytes`` (streamed weight sync)."""
        return bucket_by_bytes(self.iter_hf_weights(), bucket_bytes)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under the names transformers' in-memory model uses (what ``TorchBackend`` returns and
        the torch rollout engine loads): fused experts, tied ``lm_head`` included. Collective."""
        checkpoint = {k: v.detach().cpu().clone() for k, v in self.iter_hf_weights()}
        return module_layout(checkpoint, self.arch.tie_word_embeddings)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Accepts module- or checkpoint-named HF weights; each rank copies its own shard."""
        self.bridge.load_into(self.model, unfuse_experts(state_dict), self.ranks)
        self._model_to_main()
        if self._megatron_optimizer():  # pragma: no cover - needs CUDA
            self.optimizer.reload_model_params()  # fp32 main params follow the new weights

    # ------------------------------------------------------------------ checkpoints
    def _rank_file(self, path: str, kind: str = "") -> Path:
        return Path(path) / f"megatron{kind}_rank{dist.get_rank():05d}.pt"

    def _megatron_optimizer(self) -> bool:
        """Whether the optimizer is megatron's distributed one (GPU) rather than a torch AdamW (CPU)."""
        return self.optimizer is not None and hasattr(self.optimizer, "reload_model_params")

    def save_checkpoint(self, path: str) -> None:
        """Per rank: model shard, optimizer, scheduler, RNG. The distributed optimizer's sharded moments
        are gathered to data-parallel rank 0 of each model-parallel group (megatron's own format)."""
        os.makedirs(path, exist_ok=True)
        optimizer_state = self.optimizer.state_dict() if self.optimizer else None
        if self._megatron_optimizer():  # pragma: no cover - needs CUDA
            self.optimizer.save_parameter_state(str(self._rank_file(path, "_optimizer_params")))
        torch.save(
            {
                "model": {k: v for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")},
                "optimizer": optimizer_state,
                "main_params": self._main,
                "scheduler": self.scheduler.state_dict() if self.scheduler else None,
                "steps": getattr(self, "_steps", 0),
                "rng": rng_state(),
                "parallel": dataclasses.asdict(self.sizes),
                "world_size": dist.get_world_size(),
            },
            self._rank_file(path),
        )
        if dist.get_rank() == 0:
            meta = {
                "backend": "megatron",
                "parallel": dataclasses.asdict(self.sizes),
                "world_size": dist.get_world_size(),
            }
            (Path(path) / "megatron_meta.json").write_text(json.dumps(meta))

    def load_checkpoint(self, path: str) -> None:
        file = self._rank_file(path)
        if not file.exists():
            raise RelaxUserError(
                f"{path} holds no megatron checkpoint for rank {dist.get_rank()} ({file.name})"
            )
        state = torch.load(file, weights_only=False)
        if (
            state["parallel"] != dataclasses.asdict(self.sizes)
            or state["world_size"] != dist.get_world_size()
        ):
            raise RelaxUserError(
                f"checkpoint {path} was saved with parallel sizes {state['parallel']} on "
                f"{state['world_size']} processes; this run uses {dataclasses.asdict(self.sizes)} on "
                f"{dist.get_world_size()}. Resume with the same trainer.megatron settings"
            )
        missing, unexpected = self.model.load_state_dict(state["model"], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"checkpoint mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
        if self._main is not None:  # the fp32 main params as saved, else (an fp32 run's) the weights
            with torch.no_grad():
                for main, saved in zip(self._main, state.get("main_params") or self.model.parameters()):
                    main.copy_(saved)
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self._megatron_optimizer():  # pragma: no cover - needs CUDA
            self.optimizer.reload_model_params()
            self._load_parameter_state(str(self._rank_file(path, "_optimizer_params")))
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self._steps = state["steps"]
        set_rng_state(state["rng"])

    def _load_parameter_state(self, filename: str) -> None:  # pragma: no cover - needs CUDA
        """The distributed optimizer's main params and moments from ``filename``. Over torch's Adam (no
        Apex/Transformer Engine) each parameter's state also holds ``step``, which that file lacks (the state
        dict loaded before restored it): it is set aside while the file's tensors are copied in, under
        no_grad (they land in views of the main params, leaves that require grad)."""
        inner = [o.optimizer for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]
        steps = [{p: s.pop("step") for p, s in o.state.items() if "step" in s} for o in inner]
        try:
            with torch.no_grad():
                self.optimizer.load_parameter_state(filename)
        finally:
            for optimizer, kept in zip(inner, steps):
                for param, step in kept.items():
                    optimizer.state[param]["step"] = step

    def export_hf(self, path: str) -> None:
        """Config, safetensors (checkpoint names) and tokenizer; rank 0 writes, all ranks gather."""
        from safetensors.torch import save_file

        tensors = {k: v.detach().cpu().contiguous().clone() for k, v in self.iter_hf_weights()}
        if dist.get_rank() != 0:
            return
        os.makedirs(path, exist_ok=True)
        self.hf_config.save_pretrained(path)
        save_file(tensors, str(Path(path) / "model.safetensors"), metadata={"format": "pt"})
        try:
            from relax_models.loader import load_tokenizer

            load_tokenizer(self.model_path).save_pretrained(path)
        except (OSError, ValueError) as exc:  # a weights-only folder has no tokenizer
            log.warning("export_hf: no tokenizer copied from %s (%s)", self.model_path, exc)


def _open_checkpoint(model_path: str) -> SafetensorsCheckpoint:
    try:
        return SafetensorsCheckpoint(model_path)
    except FileNotFoundError as exc:
        raise RelaxUserError(
            f"model.path={model_path!r} has no *.safetensors weights; the megatron backend loads "
            "safetensors checkpoints only"
        ) from exc
