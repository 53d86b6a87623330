"""HF <-> Megatron conversion on one CPU process: logits parity, exact round trips, layouts, validation."""

from __future__ import annotations

import pytest
import torch
from megatron_twins import dense_config, make_hf_model, moe_config, random_ids, shared_expert_config

from relax_core.errors import RelaxUserError
from relax_models.megatron.bridge import (
    Qwen3Bridge,
    Ranks,
    SafetensorsCheckpoint,
    bucket_by_bytes,
    fuse_experts,
    module_layout,
    unfuse_experts,
)
from relax_models.megatron.model import (
    ParallelSizes,
    arch_from_hf_config,
    build_gpt_model,
    forward_logits,
    initialize_parallel,
    validate_parallel_sizes,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
torch.set_num_threads(1)

CONFIGS = {
    "dense_tied": lambda: dense_config(tie_word_embeddings=True),
    "dense_untied": lambda: dense_config(tie_word_embeddings=False),
    "moe_norm_topk": lambda: moe_config(norm_topk_prob=True),
    "moe_no_norm_all_sparse": lambda: moe_config(norm_topk_prob=False, mlp_only_layers=[]),
    "moe_shared_expert": shared_expert_config,
}


def _checkpoint_names(hf_model: torch.nn.Module, tied: bool) -> dict[str, torch.Tensor]:
    sd = unfuse_experts(hf_model.state_dict())
    return {k: v for k, v in sd.items() if not (tied and k == "lm_head.weight")}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_converted_megatron_forward_matches_hf_logits(megatron_world, name: str) -> None:
    config = CONFIGS[name]()
    hf = make_hf_model(config)
    arch = arch_from_hf_config(config)
    sizes = ParallelSizes()
    initialize_parallel(arch, sizes)
    model = build_gpt_model(arch, sizes).eval()
    bridge = Qwen3Bridge(arch, sizes)
    built = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    assert built == set(bridge.megatron_names())
    bridge.load_into(model, hf.state_dict())
    ids = random_ids(3, 13)
    with torch.no_grad():
        expected = hf(ids).logits
        got = forward_logits(model, ids, arch.vocab_size)
    assert got.shape == expected.shape
    assert expected.abs().max() > 1.0  # the comparison is not between near-zero logits
    assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_megatron_hf_round_trip_is_exact(name: str) -> None:
    config = CONFIGS[name]()
    hf = make_hf_model(config)
    arch = arch_from_hf_config(config)
    bridge = Qwen3Bridge(arch)
    reference = _checkpoint_names(hf, arch.tie_word_embeddings)
    back = bridge.megatron_to_hf([bridge.hf_to_megatron(hf.state_dict())])
    assert set(back) == set(reference) == set(bridge.hf_names())
    for key, value in reference.items():
        assert torch.equal(back[key], value), key


@pytest.mark.parametrize(
    "sizes",
    [
        ParallelSizes(tensor=2),
        ParallelSizes(tensor=4),
        ParallelSizes(expert=2),
        ParallelSizes(expert=4, tensor=2, expert_tensor=1),
        ParallelSizes(pipeline=2),
    ],
    ids=str,
)
def test_sharded_round_trip_is_exact_for_every_rank_layout(sizes: ParallelSizes) -> None:
    """Split an HF state into every rank's shard, then merge the shards back: nothing lost or moved."""
    config = moe_config(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)
    hf = make_hf_model(config)
    arch = arch_from_hf_config(config)
    bridge = Qwen3Bridge(arch, sizes)
    merged: dict[str, torch.Tensor] = {}
    for pp in range(sizes.pipeline):
        for ep in range(sizes.expert):
            shards = []
            for tp in range(sizes.tensor):
                ranks = Ranks(tp=tp, pp=pp, ep=ep, etp=tp % sizes.etp)
                shards.append(bridge.hf_to_megatron(hf.state_dict(), ranks))
            qkv = shards[0].get("decoder.layers.0.self_attention.linear_qkv.weight")
            if qkv is not None:
                assert qkv.shape[0] == (4 + 2 * 4) * 16 // sizes.tensor
            part = bridge.megatron_to_hf(shards, Ranks(pp=pp, ep=ep))
            for key, value in part.items():
                assert key not in merged or torch.equal(merged[key], value), key
                merged[key] = value
    reference = _checkpoint_names(hf, tied=True)
    assert set(merged) == set(reference)
    assert all(torch.equal(merged[k], reference[k]) for k in reference)


def test_qkv_is_interleaved_per_query_group_and_split_by_rows() -> None:
    """Megatron's layout: [q heads of group g, k_g, v_g] for each group, ranks take contiguous groups."""
    arch = arch_from_hf_config(dense_config(num_attention_heads=4, num_key_value_heads=2, head_dim=1))
    hf = {
        "model.layers.0.self_attn.q_proj.weight": torch.tensor([[0.0], [1.0], [2.0], [3.0]]),
        "model.layers.0.self_attn.k_proj.weight": torch.tensor([[10.0], [11.0]]),
        "model.layers.0.self_attn.v_proj.weight": torch.tensor([[20.0], [21.0]]),
    }
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    full = Qwen3Bridge(arch).shard_from_hf(name, hf)
    assert full.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    tp2 = Qwen3Bridge(arch, ParallelSizes(tensor=2))
    assert tp2.shard_from_hf(name, hf, Ranks(tp=1)).flatten().tolist() == [2, 3, 11, 21]


def test_gate_up_fuse_into_linear_fc1_per_rank() -> None:
    arch = arch_from_hf_config(dense_config(intermediate_size=4))
    hf = {
        "model.layers.0.mlp.gate_proj.weight": torch.tensor([[0.0], [1.0], [2.0], [3.0]]),
        "model.layers.0.mlp.up_proj.weight": torch.tensor([[10.0], [11.0], [12.0], [13.0]]),
    }
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    assert Qwen3Bridge(arch).shard_from_hf(name, hf).flatten().tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
    tp2 = Qwen3Bridge(arch, ParallelSizes(tensor=2))
    assert tp2.shard_from_hf(name, hf, Ranks(tp=1)).flatten().tolist() == [2, 3, 12, 13]


def test_vocab_is_padded_for_tensor_parallel_and_unpadded_on_export() -> None:
    arch = arch_from_hf_config(dense_config(vocab_size=101, tie_word_embeddings=False))
    bridge = Qwen3Bridge(arch, ParallelSizes(tensor=2), vocab_divisible_by=4)
    assert bridge.padded_vocab == 104
    emb = torch.randn(101, 64)
    shards = [
        bridge.shard_from_hf(
            "embedding.word_embeddings.weight", {"model.embed_tokens.weight": emb}, Ranks(tp=r)
        )
        for r in range(2)
    ]
    assert [s.shape[0] for s in shards] == [52, 52]
    assert torch.equal(shards[1][-3:], torch.zeros(3, 64))
    back = bridge.hf_from_shards("embedding.word_embeddings.weight", shards)
    assert torch.equal(back["model.embed_tokens.weight"], emb)


def test_fused_expert_layout_matches_transformers_module_and_checkpoint(tmp_path) -> None:
    """transformers keeps experts fused in memory but saves them per expert; we translate both ways."""
    hf = make_hf_model(moe_config())
    hf.save_pretrained(tmp_path)
    on_disk = SafetensorsCheckpoint(tmp_path)
    in_memory = hf.state_dict()
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in on_disk
    unfused = unfuse_experts(in_memory)
    assert set(unfused) == set(on_disk)
    assert all(torch.equal(unfused[k], on_disk[k]) for k in on_disk)
    refused = module_layout(dict(on_disk), tie_word_embeddings=False)
    assert set(refused) == set(in_memory)
    assert all(torch.equal(refused[k], in_memory[k]) for k in in_memory)
    assert fuse_experts({"a": torch.ones(1)}) == {"a": torch.ones(1)}


def test_bucket_by_bytes_respects_budget_and_order() -> None:
    items = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 10, 30, 5, 100, 1])]
    buckets = list(bucket_by_bytes(items, bucket_bytes=80))
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4"], ["t5"]]
    assert [n for b in buckets for n, _ in b] == [n for n, _ in items]
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= 80 or len(bucket) == 1
    with pytest.raises(ValueError):
        list(bucket_by_bytes(items, 0))


@pytest.mark.parametrize(
    "sizes, world_size, config, match",
    [
        (ParallelSizes(tensor=3), 3, dense_config(), "attention heads"),
        (ParallelSizes(tensor=2), 3, dense_config(), "not divisible by tensor"),
        (
            ParallelSizes(tensor=4),
            4,
            dense_config(num_attention_heads=8, num_key_value_heads=3),
            "key/value heads",
        ),
        (ParallelSizes(pipeline=3), 3, dense_config(), "number of layers"),
        (ParallelSizes(expert=2), 2, dense_config(), "dense"),
        (ParallelSizes(expert=3), 3, moe_config(), "number of experts"),
        (ParallelSizes(expert=2, expert_tensor=2), 2, moe_config(), "expert_tensor x expert"),
        (ParallelSizes(tensor=0), 1, dense_config(), "must be >= 1"),
        (ParallelSizes(context=2), 2, dense_config(), "context"),
    ],
)
def test_bad_parallel_sizes_raise_a_user_error(sizes, world_size, config, match) -> None:
    with pytest.raises(RelaxUserError, match=match):
        validate_parallel_sizes(arch_from_hf_config(config), sizes, world_size)


def test_good_parallel_sizes_return_the_data_parallel_size() -> None:
    arch = arch_from_hf_config(moe_config())
    assert validate_parallel_sizes(arch, ParallelSizes(tensor=2, expert=2), 8) == 4
    assert validate_parallel_sizes(arch, ParallelSizes(tensor=2, expert=4, expert_tensor=1), 4) == 2


def test_unsupported_architectures_are_user_errors() -> None:
    from transformers import LlamaConfig

    with pytest.raises(RelaxUserError, match="not supported"):
        arch_from_hf_config(LlamaConfig())
    with pytest.raises(RelaxUserError, match="attention_bias"):
        arch_from_hf_config(dense_config(attention_bias=True))
    with pytest.raises(RelaxUserError, match="rope scaling"):
        arch_from_hf_config(
            dense_config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0})
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is inert where CUDA exists")
def test_cpu_shim_redirects_the_cuda_device_and_can_be_undone() -> None:
    from megatron.core.tensor_parallel import random as mp_random

    from relax_models.megatron.cpu_shim import disable_cpu_shim, enable_cpu_shim

    assert enable_cpu_shim()
    try:
        assert torch.cuda.current_device() == "cpu"
        with mp_random.get_cuda_rng_tracker().fork():  # a no-op fork, not a CUDA generator swap
            pass
    finally:
        disable_cpu_shim()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()
    enable_cpu_shim()  # leave it as the module's other tests expect
