"""Tensor / expert / pipeline parallel shards across two real gloo processes (127.0.0.1 rendezvous).

One ``torch.multiprocessing`` spawn runs every case (process start and imports dominate the cost); each
rank reports numbers through a queue and the tests below assert on them.
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

WORLD = 2
CASES: dict[str, tuple[str, dict[str, Any], dict[str, int]]] = {
    # name: (family, config overrides, parallel sizes)
    "tp2_dense_tied_gqa": ("dense", {"tie_word_embeddings": True}, {"tensor": 2}),
    "tp2_dense_one_kv_head": (
        "dense",
        {"num_key_value_heads": 1, "tie_word_embeddings": False},
        {"tensor": 2},
    ),
    "tp2_moe": ("moe", {}, {"tensor": 2}),
    "ep2_moe": ("moe", {"mlp_only_layers": []}, {"expert": 2}),
    "tp2_ep2_moe": ("moe", {}, {"tensor": 2, "expert": 2, "expert_tensor": 1}),
    "tp2_shared_expert": ("shared", {}, {"tensor": 2}),
    "pp2_dense": ("dense", {"tie_word_embeddings": False}, {"pipeline": 2}),
}


def _worker(rank: int, port: int, queue: Any) -> None:
    import warnings

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    from megatron_twins import dense_config, make_hf_model, moe_config, random_ids, shared_expert_config

    from relax_models.megatron.bridge import Qwen3Bridge, Ranks, unfuse_experts
    from relax_models.megatron.cpu_shim import init_process_group
    from relax_models.megatron.model import (
        ParallelSizes,
        arch_from_hf_config,
        build_gpt_model,
        forward_logits,
        initialize_parallel,
        main_grads_to_grads,
    )

    makers = {"dense": dense_config, "moe": moe_config, "shared": shared_expert_config}
    init_process_group(rank=rank, world_size=WORLD, port=port)
    for case, (family, overrides, sizes_kw) in CASES.items():
        try:
            config = makers[family](**overrides)
            hf = make_hf_model(config)
            arch = arch_from_hf_config(config)
            sizes = ParallelSizes(**sizes_kw)
            initialize_parallel(arch, sizes)
            # eval mode = train mode here (no dropout, no aux loss), as the backend runs on CPU
            model = build_gpt_model(arch, sizes).eval()
            bridge = Qwen3Bridge(arch, sizes)
            bridge.load_into(model, hf.state_dict())
            ranks = Ranks.from_parallel_state()
            result: dict[str, Any] = {
                "names_match": {k for k in model.state_dict() if not k.endswith("_extra_state")}
                == set(bridge.megatron_names(ranks))
            }
            gathered = {k: v.clone() for k, v in bridge.iter_hf_weights(model, ranks)}
            reference = {
                k: v
                for k, v in unfuse_experts(hf.state_dict()).items()
                if not (arch.tie_word_embeddings and k == "lm_head.weight")
            }
            result["gathered_names"] = sorted(gathered)
            result["gathered_exact"] = all(torch.equal(v, reference[k]) for k, v in gathered.items())
            result["reference_names"] = sorted(reference)
            if sizes.pipeline == 1:
                ids = random_ids(3, 11)
                expected = hf(ids).logits
                got = forward_logits(model, ids, arch.vocab_size)
                result["logits_diff"] = (got - expected).abs().max().item()
                # the backward through the sharded ops gives the HF gradients
                weights = torch.linspace(-1, 1, expected.numel()).view_as(expected)
                # megatron's DDP + finalize_model_grads reduce the gradients, as in the backend
                from megatron.core.distributed import (
                    DistributedDataParallel,
                    DistributedDataParallelConfig,
                    finalize_model_grads,
                )

                ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
                got = forward_logits(ddp, ids, arch.vocab_size)
                (got * weights).sum().backward()
                (expected * weights).sum().backward()
                finalize_model_grads([ddp])
                main_grads_to_grads(model)
                for p in model.parameters():
                    p.data = p.grad
                grads = dict(bridge.iter_hf_weights(model, ranks))
                hf_grads = unfuse_experts({k: p.grad for k, p in hf.named_parameters()})
                result["grad_diff"] = max((grads[k] - hf_grads[k]).abs().max().item() for k in grads)
                result["grad_scale"] = max(hf_grads[k].abs().max().item() for k in grads)
            queue.put((rank, case, result))
        except Exception:  # report it, then stop: the other rank cannot continue the collectives alone
            queue.put((rank, case, {"error": traceback.format_exc()}))
            raise


@pytest.fixture(scope="module")
def parallel_results() -> dict[tuple[int, str], dict[str, Any]]:
    from relax_models.ports import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(free_port(), queue), nprocs=WORLD, join=True, start_method="spawn")
    results = {}
    while not queue.empty():
        rank, case, result = queue.get()
        results[(rank, case)] = result
    return results


def _result(results: dict, rank: int, case: str) -> dict[str, Any]:
    result = results.get((rank, case))
    assert result is not None, f"rank {rank} reported nothing for {case}"
    assert "error" not in result, result.get("error")
    return result


@pytest.mark.parametrize("case", [c for c in CASES if "pipeline" not in CASES[c][2]])
def test_sharded_forward_and_backward_match_hf(parallel_results, case: str) -> None:
    for rank in range(WORLD):
        r = _result(parallel_results, rank, case)
        assert r["names_match"]
        assert r["logits_diff"] < 1e-4, r["logits_diff"]
        assert r["grad_diff"] < 1e-4 * max(1.0, r["grad_scale"]), (r["grad_diff"], r["grad_scale"])


@pytest.mark.parametrize("case", [c for c in CASES if "pipeline" not in CASES[c][2]])
def test_gathering_shards_gives_back_the_hf_weights_exactly(parallel_results, case: str) -> None:
    for rank in range(WORLD):
        r = _result(parallel_results, rank, case)
        assert r["gathered_names"] == r["reference_names"]
        assert r["gathered_exact"]


def test_pipeline_stages_each_export_their_own_layers(parallel_results) -> None:
    stages = [_result(parallel_results, rank, "pp2_dense") for rank in range(WORLD)]
    assert all(s["names_match"] and s["gathered_exact"] for s in stages)
    first, last = (set(s["gathered_names"]) for s in stages)
    assert not first & last
    assert sorted(first | last) == stages[0]["reference_names"]
    assert "model.embed_tokens.weight" in first and "model.layers.0.input_layernorm.weight" in first
    assert "lm_head.weight" in last and "model.layers.1.input_layernorm.weight" in last
