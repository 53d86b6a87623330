"""Rollout engines behind :class:`relax_core.engines.base.RolloutEngine`, built by name."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from relax_core.config.options import Option
from relax_core.engines.base import EngineSetup, RolloutEngine, engine_dtype

if TYPE_CHECKING:
    from relax_core.config.schema import ModelConfig, RolloutConfig

ENGINES = Option(
    "rollout.engine",
    {
        "torch": "relax_core.engines.torch_engine:TorchEngine",
        "sglang": "relax_core.engines.sglang:SGLangEngine",
        "vllm": "relax_core.engines.vllm:VLLMEngine",
    },
)


def build_engine(
    name: str,
    model_path: str,
    tokenizer,
    model_cfg: ModelConfig | None,
    seed: int,
    rollout_cfg: RolloutConfig | None = None,
    engine_url: str | None = None,
    record_routing: bool = False,
    lora_rank: int = 0,
) -> RolloutEngine:
    """The engine ``rollout.engine`` names, loaded from ``model_path`` (or a client of ``engine_url``);
    ``record_routing`` (``algorithm.routing_replay``, the torch engine only): results carry MoE routing."""
    if engine_url:
        from relax_core.engines.client import HttpEngine

        tokens = rollout_cfg.engine_tokens if rollout_cfg is not None else {}
        return HttpEngine(engine_url, base_model_path=model_path, token=tokens.get(engine_url.rstrip("/")))
    setup = EngineSetup(model_path, seed, rollout_cfg, model_cfg, tokenizer, record_routing, lora_rank)
    return ENGINES.load(name).from_config(setup)


def adapter_sync_rank(cfg: Any) -> int:
    """The LoRA rank whose adapters the policy's engines receive (``trainer.lora.engine_sync=adapter`` and an
    engine class that serves LoRA, ``max_lora_rank``); 0: engines get merged weights."""
    lora = cfg.trainer.lora
    if not lora.rank or lora.engine_sync != "adapter":  # (a LoRA run's backend is torch: validation)
        return 0
    return lora.rank if ENGINES.load(cfg.rollout.engine).max_lora_rank is not None else 0


__all__ = ["ENGINES", "EngineSetup", "RolloutEngine", "adapter_sync_rank", "build_engine", "engine_dtype"]
