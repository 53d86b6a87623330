"""Rollout engines behind :class:`relax_core.engines.base.RolloutEngine`, built by name."""

from __future__ import annotations

from relax_core.engines.base import RolloutEngine, engine_dtype
from relax_core.errors import RelaxUserError

ENGINES = ["torch", "sglang", "vllm"]


def build_engine(
    name: str,
    model_path: str,
    tokenizer,
    model_cfg,
    seed: int,
    rollout_cfg=None,
    engine_url: str | None = None,
    record_routing: bool = False,
) -> RolloutEngine:
    """The engine ``rollout.engine`` names, loaded from ``model_path`` (or a client of ``engine_url``);
    ``record_routing`` (``algorithm.routing_replay``, the torch engine only): results carry MoE routing."""
    if engine_url:
        from relax_core.engines.client import HttpEngine

        tokens = rollout_cfg.engine_tokens if rollout_cfg is not None else {}
        return HttpEngine(engine_url, base_model_path=model_path, token=tokens.get(engine_url.rstrip("/")))
    if name == "torch":
        from transformers import AutoConfig

        from relax_core.engines.torch_engine import TorchEngine
        from relax_models.families import FAMILIES, family_for_model_type
        from relax_models.loader import DTYPES

        family = family_for_model_type(AutoConfig.from_pretrained(model_path).model_type)
        from relax_core.placement import role_device

        model = FAMILIES[family].load(model_path, DTYPES[model_cfg.dtype], model_cfg.attn_implementation)
        model = model.to(role_device())  # the engine decodes on its model's device
        dtype = engine_dtype(rollout_cfg.dtype) if rollout_cfg is not None else None
        return TorchEngine(
            model,
            tokenizer.pad_token_id,
            [tokenizer.eos_token_id],
            seed=seed,
            tokenizer=tokenizer,
            family=family,
            max_running=rollout_cfg.max_running if rollout_cfg is not None else 1024,
            dtype=dtype,
            native_kernels=rollout_cfg.native_kernels if rollout_cfg is not None else False,
            record_routing=record_routing,
            kv_cache_tokens=rollout_cfg.kv_cache_tokens if rollout_cfg is not None else None,
        )
    if name == "sglang":
        from relax_core.engines.sglang import SGLangEngine

        return SGLangEngine.from_config(model_path, seed, rollout_cfg)
    if name == "vllm":
        from relax_core.engines.vllm import VLLMEngine

        return VLLMEngine.from_config(model_path, seed, rollout_cfg)
    raise RelaxUserError(f"rollout.engine={name!r} is not available; choose one of {ENGINES}")
