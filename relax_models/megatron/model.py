"""Build a megatron-core ``GPTModel`` that computes the same function as an HF Qwen3 / Qwen3-MoE model.

The HF config is first reduced to an :class:`ArchSpec` (only the facts both the model builder and the
weight bridge need), so the bridge never has to re-read HF config quirks. Parallel sizes are checked
against the world size and the architecture *before* megatron builds anything, because megatron's own
asserts fire deep inside module constructors with messages that do not name the user's setting.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from relax_models.errors import RelaxUserError
from relax_models.megatron.cpu_shim import (
    cuda_available,
    enable_cpu_shim,
    fill_missing_transformer_engine,
)

SUPPORTED_FAMILIES = ("qwen3", "qwen3_moe", "qwen2_moe")


@dataclass(frozen=True)
class ParallelSizes:
    """Megatron parallel sizes; data parallel is whatever is left of the world size.

    ``expert_tensor=None`` means "same as ``tensor``" (megatron-core's default).
    """

    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1
    expert_tensor: int | None = None

    @property
    def etp(self) -> int:
        return self.expert_tensor if self.expert_tensor is not None else self.tensor

    @classmethod
    def from_config(cls, cfg: Any) -> ParallelSizes:
        """From a mapping/dataclass with keys ``tensor``, ``pipeline``, ``context``, ``expert``
        (and optional ``expert_tensor``); ``None`` gives the defaults (no parallelism)."""
        if cfg is None:
            return cls()
        if dataclasses.is_dataclass(cfg):
            cfg = dataclasses.asdict(cfg)
        get = cfg.get if hasattr(cfg, "get") else lambda k, d=None: getattr(cfg, k, d)
        return cls(
            tensor=int(get("tensor", 1) or 1),
            pipeline=int(get("pipeline", 1) or 1),
            context=int(get("context", 1) or 1),
            expert=int(get("expert", 1) or 1),
            expert_tensor=None if get("expert_tensor", None) is None else int(get("expert_tensor")),
        )


@dataclass(frozen=True)
class ArchSpec:
    """Architecture of a Qwen3-family causal LM, in the terms the builder and the bridge share."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    qkv_bias: bool
    # MoE (num_experts == 0 for dense models)
    num_experts: int = 0
    moe_top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()
    shared_expert_intermediate_size: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and self.moe_layers[layer]

    def padded_vocab_size(self, tensor: int, divisible_by: int = 1) -> int:
        """Vocab rounded up so each tensor-parallel rank holds an equal slice of the embedding."""
        multiple = divisible_by * tensor
        return -(-self.vocab_size // multiple) * multiple


def _rope_theta(hf_config: Any) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None):
        raise RelaxUserError(
            f"rope scaling {rope_type!r} is not supported by the megatron backend; "
            "use trainer.backend=torch or a checkpoint without rope_scaling"
        )
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise RelaxUserError("the model config has no rope_theta")
    return float(theta)


def arch_from_hf_config(hf_config: Any) -> ArchSpec:
    """Read an HF ``Qwen3Config`` / ``Qwen3MoeConfig`` (or ``Qwen2MoeConfig``, for shared experts)."""
    family = getattr(hf_config, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise RelaxUserError(
            f"model family {family!r} is not supported by the megatron backend "
            f"(supported: {', '.join(SUPPORTED_FAMILIES)}); use trainer.backend=torch"
        )
    if getattr(hf_config, "use_sliding_window", False):
        raise RelaxUserError("sliding-window attention is not supported by the megatron backend")
    if family == "qwen3" and getattr(hf_config, "attention_bias", False):
        raise RelaxUserError(
            "attention_bias=True (bias on q/k/v *and* o_proj) has no megatron-core equivalent"
        )
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise RelaxUserError(f"hidden_act={hf_config.hidden_act!r}: only silu (SwiGLU) is supported")
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    common = dict(
        family=family,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        intermediate_size=hf_config.intermediate_size,
        rms_norm_eps=float(hf_config.rms_norm_eps),
        rope_theta=_rope_theta(hf_config),
        max_position_embeddings=hf_config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        qkv_bias=family == "qwen2_moe" and bool(getattr(hf_config, "qkv_bias", True)),
    )
    if family == "qwen3":
        return ArchSpec(**common)
    mlp_only = set(getattr(hf_config, "mlp_only_layers", None) or [])
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    n_exp = hf_config.num_experts
    moe_layers = tuple(
        i not in mlp_only and n_exp > 0 and (i + 1) % step == 0 for i in range(hf_config.num_hidden_layers)
    )
    return ArchSpec(
        **common,
        num_experts=n_exp,
        moe_top_k=hf_config.num_experts_per_tok,
        moe_intermediate_size=hf_config.moe_intermediate_size,
        norm_topk_prob=bool(hf_config.norm_topk_prob),
        moe_layers=moe_layers,
        shared_expert_intermediate_size=int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0),
    )


def validate_parallel_sizes(arch: ArchSpec, sizes: ParallelSizes, world_size: int) -> int:
    """Check ``sizes`` against the world and the architecture; returns the data-parallel size.

    Every failure is a :class:`RelaxUserError` naming the ``trainer.megatron.*`` key to change.
    """
    for name in ("tensor", "pipeline", "context", "expert"):
        if getattr(sizes, name) < 1:
            raise RelaxUserError(f"trainer.megatron.{name}={getattr(sizes, name)} must be >= 1")
    if sizes.etp < 1:
        raise RelaxUserError(f"trainer.megatron.expert_tensor={sizes.etp} must be >= 1")
    model_parallel = sizes.tensor * sizes.pipeline * sizes.context
    if world_size % model_parallel:
        raise RelaxUserError(
            f"world size {world_size} is not divisible by tensor x pipeline x context = "
            f"{sizes.tensor} x {sizes.pipeline} x {sizes.context} = {model_parallel}; "
            "change trainer.megatron.{tensor,pipeline,context} or the number of training processes"
        )
    expert_parallel = sizes.etp * sizes.expert * sizes.pipeline
    if world_size % expert_parallel:
        raise RelaxUserError(
            f"world size {world_size} is not divisible by expert_tensor x expert x pipeline = "
            f"{sizes.etp} x {sizes.expert} x {sizes.pipeline} = {expert_parallel}"
        )
    tp = sizes.tensor
    if arch.num_heads % tp:
        raise RelaxUserError(
            f"trainer.megatron.tensor={tp} must divide the number of attention heads ({arch.num_heads})"
        )
    if arch.num_kv_heads % tp and tp % arch.num_kv_heads:
        raise RelaxUserError(
            f"trainer.megatron.tensor={tp} and the number of key/value heads ({arch.num_kv_heads}) "
            "must divide one another"
        )
    if arch.intermediate_size % tp:
        raise RelaxUserError(
            f"trainer.megatron.tensor={tp} must divide intermediate_size ({arch.intermediate_size})"
        )
    if arch.num_layers % sizes.pipeline:
        raise RelaxUserError(
            f"trainer.megatron.pipeline={sizes.pipeline} must divide the number of layers ({arch.num_layers})"
        )
    if sizes.context > 1 and not cuda_available():
        raise RelaxUserError(
            "trainer.megatron.context>1 needs Transformer Engine attention on a GPU; use context=1 on CPU"
        )
    if arch.is_moe:
        if arch.num_experts % sizes.expert:
            raise RelaxUserError(
                f"trainer.megatron.expert={sizes.expert} must divide the number of experts ({arch.num_experts})"
            )
        if arch.moe_intermediate_size % sizes.etp:
            raise RelaxUserError(
                f"expert tensor parallel size {sizes.etp} must divide moe_intermediate_size "
                f"({arch.moe_intermediate_size})"
            )
        if arch.shared_expert_intermediate_size % tp:
            raise RelaxUserError(
                f"trainer.megatron.tensor={tp} must divide shared_expert_intermediate_size "
                f"({arch.shared_expert_intermediate_size})"
            )
    elif sizes.expert > 1 or sizes.expert_tensor not in (None, sizes.tensor):
        raise RelaxUserError(
            f"trainer.megatron.expert={sizes.expert} needs a mixture-of-experts model; "
            f"{arch.family!r} is dense (set expert=1)"
        )
    return world_size // model_parallel


_ACTIVE_SIZES: tuple[ParallelSizes, int] | None = None


def initialize_parallel(arch: ArchSpec, sizes: ParallelSizes, seed: int = 0) -> int:
    """Validate, then create megatron's process groups on top of the default group; returns DP size.

    The default ``torch.distributed`` group must exist (see ``cpu_shim.init_process_group``). Groups that
    already exist with the same sizes are kept; different sizes replace them (models built on the old
    groups must not be used afterwards). On CPU the shim is applied; on GPU megatron's CUDA RNG tracker
    is seeded instead.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call cpu_shim.init_process_group first")
    global _ACTIVE_SIZES
    dp = validate_parallel_sizes(arch, sizes, dist.get_world_size())
    if parallel_state.model_parallel_is_initialized():
        if _ACTIVE_SIZES == (sizes, dist.get_world_size()):
            # a second model in this process (e.g. Actor + Reference): keep the groups the first uses
            enable_cpu_shim()
            return dp
        parallel_state.destroy_model_parallel()
    _ACTIVE_SIZES = (sizes, dist.get_world_size())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=sizes.tensor,
        pipeline_model_parallel_size=sizes.pipeline,
        context_parallel_size=sizes.context,
        expert_model_parallel_size=sizes.expert,
        expert_tensor_parallel_size=sizes.expert_tensor,
    )
    if not enable_cpu_shim():
        fill_missing_transformer_engine()
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    return dp


def transformer_config(
    arch: ArchSpec, sizes: ParallelSizes, dtype: torch.dtype = torch.float32, **overrides: Any
) -> Any:
    """The megatron ``TransformerConfig`` equivalent to ``arch`` (fusions off on CPU)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_gpu = cuda_available()
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        use_cpu_initialization=not on_gpu,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=sizes.tensor,
        pipeline_model_parallel_size=sizes.pipeline,
        context_parallel_size=sizes.context,
        expert_model_parallel_size=sizes.expert,
        expert_tensor_parallel_size=sizes.expert_tensor,
        # GPU + TE: sequence parallel (megatron requires it for MoE with TP in training). CPU: torch
        # norms cannot run sequence parallel; see ``main_grads_to_grads`` for what that implies.
        sequence_parallel=on_gpu and _have_transformer_engine() and sizes.tensor > 1,
    )
    if arch.is_moe:
        kwargs.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.moe_top_k,
            moe_ffn_hidden_size=arch.moe_intermediate_size,
            moe_layer_freq=[int(m) for m in arch.moe_layers],
            # HF: softmax over all experts, top-k, renormalise iff norm_topk_prob. Megatron's default
            # (top-k of logits, then softmax over the k) is exactly the renormalised form.
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not arch.norm_topk_prob,
            # fp32 routing in bf16 runs; its GEMM path needs Transformer Engine
            moe_router_dtype="fp32" if on_gpu and _have_transformer_engine() else None,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall" if on_gpu else "allgather",
            moe_grouped_gemm=False,
        )
        if arch.shared_expert_intermediate_size:
            kwargs.update(
                moe_shared_expert_intermediate_size=arch.shared_expert_intermediate_size,
                moe_shared_expert_gate=True,
            )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def block_spec(config: Any, use_transformer_engine: bool) -> Any:
    """Per-layer megatron specs (dense or MoE per ``config.moe_layer_freq``), this pipeline stage's slice.

    Local (pure torch) modules on CPU; Transformer Engine modules on GPU when it is installed.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_transformer_engine, normalization="RMSNorm"
    )


def uses_transformer_engine() -> bool:
    """Whether :func:`build_gpt_model` picks Transformer Engine specs by default (GPU with TE)."""
    return cuda_available() and _have_transformer_engine()


def _have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def build_gpt_model(
    arch: ArchSpec,
    sizes: ParallelSizes,
    dtype: torch.dtype = torch.float32,
    vocab_divisible_by: int = 1,
    use_transformer_engine: bool | None = None,
    **config_overrides: Any,
) -> torch.nn.Module:
    """This rank's ``GPTModel`` shard; :func:`initialize_parallel` must have run with the same ``sizes``.

    The vocab is padded (see :meth:`ArchSpec.padded_vocab_size`); logits beyond ``arch.vocab_size``
    belong to padding rows and must be sliced off by the caller.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel

    if use_transformer_engine is None:
        use_transformer_engine = uses_transformer_engine()
    config = transformer_config(arch, sizes, dtype, **config_overrides)
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(config, use_transformer_engine),
        vocab_size=arch.padded_vocab_size(sizes.tensor, vocab_divisible_by),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
    )
    if cuda_available():
        model = model.cuda()
    return model


def is_expert_param(name: str) -> bool:
    """Routed-expert weights (sharded over expert-tensor/expert-parallel groups, not TP/DP)."""
    return ".mlp.experts." in name


def main_grads_to_grads(model: torch.nn.Module, main_params: list[torch.Tensor] | None = None) -> None:
    """After megatron's ``finalize_model_grads`` on CPU: the reduced fp32 ``main_grad`` buffers become the
    ``.grad`` a plain torch optimizer reads: of the parameters, or, given ``main_params`` (fp32 copies of a
    bf16 model's parameters, in order), of those, in fp32.

    Without sequence parallelism (CPU) every tensor-parallel rank routes the same tokens, and the MoE
    all-gather dispatcher hands each token to an expert once per TP rank; megatron (which requires
    sequence parallelism for MoE + TP in training) does not correct for that, so expert gradients are
    divided by the TP size here.
    """
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    named = list(model.named_parameters())
    for (name, p), target in zip(named, main_params or [p for _, p in named]):
        grad = getattr(p, "main_grad", None)
        if grad is None:
            continue
        if tp > 1 and is_expert_param(name):
            grad = grad / tp
        target.grad = grad.to(target.dtype)


def forward_logits(model: torch.nn.Module, input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full-vocab logits ``[B, L, V]`` of a (possibly tensor-parallel) ``GPTModel`` on right-padded ids.

    A causal mask alone is exact for right padding (pads only follow real tokens). It is passed
    explicitly because megatron's default one is allocated on ``"cuda"`` (True = masked out). Vocab
    shards are all-gathered (autograd-aware) and the padding rows dropped.
    """
    config = getattr(model, "config", None)
    if config is not None and config.sequence_parallel:  # sequence must split evenly over TP ranks
        pad = -input_ids.shape[1] % config.tensor_model_parallel_size
        if pad:
            filler = input_ids.new_zeros(input_ids.shape[0], pad)
            return forward_logits(model, torch.cat([input_ids, filler], dim=1), vocab_size)[:, :-pad]
    batch, length = input_ids.shape
    device = input_ids.device
    position_ids = torch.arange(length, device=device).unsqueeze(0).expand(batch, -1)
    causal = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)[None, None]
    logits = model(input_ids, position_ids, attention_mask=causal, runtime_gather_output=True)
    return logits[..., :vocab_size]
