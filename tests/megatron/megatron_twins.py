"""Tiny random-init HF Qwen3 / Qwen3-MoE / Qwen2-MoE twins shared by the megatron tests.

Weights use a wide init (std 0.1) so logits are O(1) and expert routing is decisive, and every 1-D
weight (RMSNorm gains, q/k norms, qkv bias) is perturbed away from its constant init, so a mapping that
swaps or drops one of them changes the logits.
"""

from __future__ import annotations

import warnings

import torch
from transformers import (
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB = 100
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    rope_theta=10000.0,
    initializer_range=0.1,
)
FIXED_SEED = 1234

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*Apex.*")


def dense_config(**overrides) -> Qwen3Config:
    """Qwen3 with GQA (4 q heads, 2 kv heads) and head_dim 24 != hidden/heads (16)."""
    kw = dict(COMMON, head_dim=24, num_key_value_heads=2, tie_word_embeddings=True)
    kw.update(overrides)
    return Qwen3Config(**kw)


def moe_config(**overrides) -> Qwen3MoeConfig:
    """Qwen3-MoE: 4 experts, top-2, layer 1 dense via ``mlp_only_layers`` unless overridden."""
    kw = dict(
        COMMON,
        head_dim=16,
        num_key_value_heads=2,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def shared_expert_config(**overrides) -> Qwen2MoeConfig:
    """Qwen2-MoE: routed experts plus a sigmoid-gated shared expert, and qkv bias."""
    kw = dict(
        COMMON,
        num_key_value_heads=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=4,
        num_experts_per_tok=2,
    )
    kw.update(overrides)
    return Qwen2MoeConfig(**kw)


_CLASSES = {"qwen3": Qwen3ForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM, "qwen2_moe": Qwen2MoeForCausalLM}


def make_hf_model(config, seed: int = FIXED_SEED) -> torch.nn.Module:
    """The HF model for ``config`` with deterministic random weights, in eval mode."""
    torch.manual_seed(seed)
    model = _CLASSES[config.model_type](config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                base = 0.0 if name.endswith("bias") else 1.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))
    return model


def random_ids(batch: int, length: int, seed: int = 7) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
