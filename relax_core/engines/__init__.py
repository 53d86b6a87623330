"""Rollout engines behind :class:`relax_core.engines.base.RolloutEngine`, built by name."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax_core.engines.base import EngineSetup, RolloutEngine, engine_dtype
from relax_core.options import Option

if TYPE_CHECKING:
    from relax_core.config import ModelConfig, RolloutConfig

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
) -> RolloutEngine:
    """The engine ``rollout.engine`` names, loaded from ``model_path`` (or a client of ``engine_url``);
    ``record_routing`` (``algorithm.routing_replay``, the torch engine only): results carry MoE routing."""
    if engine_url:
        from relax_core.engines.client import HttpEngine

        tokens = rollout_cfg.engine_tokens if rollout_cfg is not None else {}
        return HttpEngine(engine_url, base_model_path=model_path, token=tokens.get(engine_url.rstrip("/")))
    setup = EngineSetup(model_path, seed, rollout_cfg, model_cfg, tokenizer, record_routing)
    return ENGINES.load(name).from_config(setup)


__all__ = ["ENGINES", "EngineSetup", "RolloutEngine", "build_engine", "engine_dtype"]
