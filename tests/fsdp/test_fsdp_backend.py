"""FSDP2 Actor backend over two real gloo processes against the single-process torch backend.

One ``torch.multiprocessing`` spawn runs every check (process start and imports dominate the cost); each
rank reports tensors through a queue, and the tests compare them with an unsharded ``TorchBackend`` taking
the same steps on the same global batch in the test process.
"""

from __future__ import annotations

import dataclasses
import math
import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from relax_core.algorithms.objective import micro_batch_weight, policy_objective, sequence_count
from relax_core.config.schema import (
    AlgorithmConfig,
    CriticConfig,
    LoRAConfig,
    ModelConfig,
    RelaxConfig,
    TrainerConfig,
)
from relax_core.samples import Sample, TrainBatch

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

WORLD = 2
# clipping active (the tiny model's first gradient norm is well above 0.5): the norm must span all shards
TRAINER = TrainerConfig(lr=1e-3, lr_decay="constant", grad_clip=0.5, fsdp=True, dp_size=WORLD)
# the recipes' learning rate, which bf16 parameters would round away
BF16_TRAINER = dataclasses.replace(TRAINER, lr=1e-6)
LORA_TRAINER = dataclasses.replace(TRAINER, lora=LoRAConfig(rank=4, alpha=8))
# packed micro-batches of at most 21 tokens: rank 0's rows form 4 groups, rank 1's 3
PACKED_TRAINER = dataclasses.replace(TRAINER, max_tokens_per_micro_batch=21)
ALGO = AlgorithmConfig(loss_agg_mode="token-mean", entropy_coef=0.01)


def make_batch(tokenizer) -> TrainBatch:
    """8 samples of varied prompt/response lengths, some tokens masked, advantages of both signs."""
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(8):
        prompt = tokenizer(f"sort {'3' * (i % 3 + 1)}{i}:", add_special_tokens=False).input_ids
        r = 2 + (i * 3) % 6
        response = torch.randint(3, len(tokenizer), (r,), generator=gen).tolist()
        mask = [1] * r
        if i % 3 == 1:
            mask[0] = 0
        samples.append(Sample(i // 2, i % 2, prompt, response, [0.0] * r, mask, reward=float(i % 2)))
    batch = TrainBatch.from_samples(samples, tokenizer.pad_token_id)
    batch.extras["advantages"] = torch.linspace(-1.0, 1.2, len(batch)).unsqueeze(1) * batch.loss_mask
    return batch


def objective_step(backend, batch: TrainBatch, micro: int, scale: float = 1.0) -> dict[str, float]:
    """One optimizer step the way the Actor takes it: micro-batch weights from the *global* batch (the
    loss times ``scale``)."""
    total_tokens, total_seqs = float(batch.loss_mask.sum()), sequence_count(batch, ALGO)

    def loss_fn(mb, logprobs, entropy):
        weight = micro_batch_weight(mb, total_tokens, total_seqs, ALGO)
        loss, metrics = policy_objective(mb, logprobs, entropy, ALGO, weight)
        return loss * scale, metrics

    return backend.train_step(batch, loss_fn, micro)


def nonfinite_step(backend, batch: TrainBatch, rank: int) -> dict[str, Any]:
    """A step whose loss is NaN on rank 1 only: the reduced loss and the global gradient norm are NaN on
    every rank, so every rank must skip the update (a rank that stepped alone would change the gathered
    weights). The step's metrics, and whether the weights stayed exactly as they were."""
    before = backend.state_dict()
    metrics = objective_step(backend, batch, micro=2, scale=float("nan") if rank == 1 else 1.0)
    after = backend.state_dict()
    return {"metrics": metrics, "unchanged": all(torch.equal(after[k], v) for k, v in before.items())}


def trajectory(backend, batch: TrainBatch, checkpoint: Path) -> dict[str, Any]:
    """What both the sharded and the plain backend report: log-probs, two steps, a checkpoint between."""
    out: dict[str, Any] = {"logprobs": backend.forward_logprobs(batch, 3)}
    out["step1"] = objective_step(backend, batch, micro=2)  # 2 micro-batches per rank
    out["weights1"] = backend.state_dict()
    backend.save_checkpoint(str(checkpoint))
    out["step2"] = objective_step(backend, batch, micro=2)
    out["weights2"] = backend.state_dict()
    return out


def bf16_step(backend, batch: TrainBatch) -> dict[str, Any]:
    """One step of a ``model.dtype=bfloat16`` backend at lr 1e-6: the dtypes of its shards, AdamW state,
    forward and published weights, and how far the step moved the shards."""
    forward_dtypes: set[torch.dtype] = set()
    for module in backend.model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda _m, _i, out: forward_dtypes.add(out.dtype))
    before = [p.to_local().detach().clone() for p in backend.model.parameters()]
    objective_step(backend, batch, micro=2)
    after = [p.to_local().detach() for p in backend.model.parameters()]
    deltas = torch.cat([(a - b).abs().flatten() for a, b in zip(after, before)])
    state = [t for s in backend.optimizer.state.values() for k, t in s.items() if k != "step"]
    return {
        "shard_dtypes": {t.dtype for t in after},
        "state_dtypes": {(t.to_local() if hasattr(t, "to_local") else t).dtype for t in state},
        "forward_dtypes": forward_dtypes,
        "moved": float((deltas > BF16_TRAINER.lr / 2).float().mean()),
        "max_delta": float(deltas.max()),
        "weight_dtypes": {t.dtype for t in backend.state_dict().values()},
    }


def critic_config() -> RelaxConfig:
    """PPO's Critic on the same ranks: clipping active, 2 micro-batches per rank."""
    critic = CriticConfig(lr=1e-2, grad_clip=0.5, micro_batch_size=2)
    return RelaxConfig(trainer=TRAINER, algorithm=AlgorithmConfig(critic=critic))


def critic_trajectory(critic, batch: TrainBatch) -> dict[str, Any]:
    """What two colocate steps ask of the Critic: values, then a fit on the GAE returns, twice (the zero
    value head lets no gradient into the trunk on the first fit); its local parameter count and class."""
    batch = dataclasses.replace(batch, extras=dict(batch.extras))
    params = critic.backend.model.parameters()
    local_numel = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
    out: dict[str, Any] = {"kind": type(critic.backend).__name__, "local_numel": local_numel}
    for step in (1, 2):
        out[f"values{step}"] = batch.extras["values"] = critic.compute_values(batch)
        out[f"fit{step}"] = critic.fit(batch)
    out["values3"] = critic.compute_values(batch)
    return out


def _worker(rank: int, port: int, model_dir: str, tmp: str, queue: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        from relax_core.backends import build_backend
        from relax_core.backends.fsdp_backend import FSDPBackend
        from relax_core.roles.critic import Critic
        from relax_models.loader import load_tokenizer

        batch = make_batch(load_tokenizer(model_dir))
        torch.manual_seed(3)
        backend = FSDPBackend(model_dir, TRAINER, ModelConfig())
        loaded = {"weights": backend.state_dict(), "buffers": dict(backend.model.named_buffers())}
        result = trajectory(backend, batch, Path(tmp) / "ckpt") | {"loaded": loaded}
        buckets = list(backend.iter_weights(bucket_bytes=40_000))
        result["bucket_sizes"] = [sum(t.numel() * t.element_size() for t in b.values()) for b in buckets]
        result["bucket_names"] = [name for b in buckets for name in b]
        result["local_numel"] = sum(p.to_local().numel() for p in backend.model.parameters())
        backend.export_hf(str(Path(tmp) / "export"))
        result["nonfinite"] = nonfinite_step(backend, batch, rank)
        # the Reference of a colocate run with trainer.fsdp: frozen, sharded over the same number of ranks
        reference = build_backend(
            "torch", model_dir, TRAINER, ModelConfig(), 1.0, 0, trainable=False, sharded=True
        )
        result["reference"] = {
            "kind": type(reference).__name__,
            "optimizer": reference.optimizer,
            "local_numel": sum(p.to_local().numel() for p in reference.model.parameters()),
            "logprobs": reference.forward_logprobs(batch, 3),
        }
        # a frozen backend (no optimizer) restores the model weights of a checkpoint saved with one
        reference.load_checkpoint(str(Path(tmp) / "ckpt"))
        result["reference"]["restored"] = reference.state_dict()
        result["critic"] = critic_trajectory(Critic(critic_config(), model_dir, sharded=True), batch)
        # token-budget packing: the rank with fewer groups splits one, so both run as many micro-batches
        from relax_core.backends.base import rank_slice, row_lengths, token_budget_groups

        packed = FSDPBackend(model_dir, PACKED_TRAINER, ModelConfig())
        lengths = row_lengths(rank_slice(batch, rank, WORLD))
        result["packed"] = {
            "own_groups": len(token_budget_groups(lengths, PACKED_TRAINER.max_tokens_per_micro_batch)),
            "micro_batches": len(packed._budget_groups(rank_slice(batch, rank, WORLD))),
            "logprobs": packed.forward_logprobs(batch, 3),
            "step1": objective_step(packed, batch, micro=2),
            "weights1": packed.state_dict(),
        }
        result["bf16"] = bf16_step(FSDPBackend(model_dir, BF16_TRAINER, ModelConfig(dtype="bfloat16")), batch)
        # exact resume: a fresh backend loads the step-1 checkpoint and retakes step 2
        torch.manual_seed(99)  # the checkpoint's RNG state must win over this
        resumed = FSDPBackend(model_dir, TRAINER, ModelConfig())
        resumed.load_checkpoint(str(Path(tmp) / "ckpt"))
        result["resumed_step2"] = objective_step(resumed, batch, micro=2)
        result["resumed_weights2"] = resumed.state_dict()
        # LoRA: sharded adapters over frozen sharded base weights, merged on the way out; exact resume
        torch.manual_seed(5)
        lora = FSDPBackend(model_dir, LORA_TRAINER, ModelConfig())
        result["lora"] = trajectory(lora, batch, Path(tmp) / "lora_ckpt")
        lora.export_hf(str(Path(tmp) / "lora_export"))
        torch.manual_seed(99)
        resumed = FSDPBackend(model_dir, LORA_TRAINER, ModelConfig())
        resumed.load_checkpoint(str(Path(tmp) / "lora_ckpt"))
        result["lora"] |= {"resumed_step2": objective_step(resumed, batch, micro=2)}
        result["lora"] |= {"resumed_weights2": resumed.state_dict()}
        torch.save(result, Path(tmp) / f"result{rank}.pt")  # tensors outlive the process, unlike a queue's
    except Exception:
        queue.put((rank, traceback.format_exc()))
        raise


@pytest.fixture(scope="module")
def sharded(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    from relax_models.megatron.cpu_shim import free_port

    tmp = tmp_path_factory.mktemp("fsdp")
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        _worker, args=(free_port(), str(tiny_model_dir), str(tmp), queue), nprocs=WORLD, start_method="spawn"
    )
    errors = []
    while not queue.empty():
        errors.append(queue.get())
    assert not errors, errors
    results: dict[Any, Any] = {rank: torch.load(tmp / f"result{rank}.pt") for rank in range(WORLD)}
    results["dir"] = tmp
    return results


@pytest.fixture(scope="module")
def single(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same steps on one unsharded process (the default torch path)."""
    from relax_core.backends.torch_backend import TorchBackend
    from relax_core.roles.critic import Critic
    from relax_models.loader import load_tokenizer

    batch = make_batch(load_tokenizer(str(tiny_model_dir)))
    backend = TorchBackend(
        str(tiny_model_dir), dataclasses.replace(TRAINER, fsdp=False, dp_size=1), ModelConfig()
    )
    out = trajectory(backend, batch, tmp_path_factory.mktemp("single") / "ckpt")
    torch.manual_seed(5)
    lora_trainer = dataclasses.replace(LORA_TRAINER, fsdp=False, dp_size=1)
    lora = TorchBackend(str(tiny_model_dir), lora_trainer, ModelConfig())
    out["lora"] = trajectory(lora, batch, tmp_path_factory.mktemp("single_lora") / "ckpt")
    return out | {"critic": critic_trajectory(Critic(critic_config(), str(tiny_model_dir)), batch)}


def _assert_weights_close(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float = 1e-6
) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=atol, msg=name)


def _assert_first_adam_step_close(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], lr: float
) -> None:
    """Weights after one Adam step from the same start: Adam's first step is ±lr per element whatever |g|,
    so an element whose gradient is near zero may step the other way under another rounding (seen on an
    AVX2 host, not on AVX-512 ones); every element is within 2·lr, and all but 0.1% within 1e-2·lr."""
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        diff = (got[name] - tensor).abs()
        assert float(diff.max()) <= 2 * lr * (1 + 1e-3), name
        assert float((diff > 1e-2 * lr).float().mean()) <= 1e-3, name


def test_two_ranks_match_one_rank_loss_grad_norm_and_weights(sharded, single) -> None:
    for rank in range(WORLD):
        r = sharded[rank]
        torch.testing.assert_close(r["logprobs"], single["logprobs"], rtol=1e-5, atol=1e-5)
        for step in ("step1", "step2"):
            assert r[step]["loss"] == pytest.approx(single[step]["loss"], rel=1e-5, abs=1e-6)
            assert r[step]["grad_norm"] == pytest.approx(single[step]["grad_norm"], rel=1e-5)
        assert single["step1"]["grad_norm"] > TRAINER.grad_clip  # clipping was exercised
        _assert_weights_close(r["weights1"], single["weights1"])
        _assert_weights_close(r["weights2"], single["weights2"])


def test_packed_micro_batches_on_two_ranks_match_one_padded_rank(sharded, single) -> None:
    """``trainer.max_tokens_per_micro_batch`` with FSDP: each rank packs its rows by the token budget, the
    rank with fewer groups splits its largest (every micro-batch's forward and backward are collective),
    and the log-probs, loss, gradient norm and weights are one padded rank's (to float rounding)."""
    assert [sharded[rank]["packed"]["own_groups"] for rank in range(WORLD)] == [4, 3]
    for rank in range(WORLD):
        r = sharded[rank]["packed"]
        assert r["micro_batches"] == 4
        torch.testing.assert_close(r["logprobs"], single["logprobs"], rtol=1e-5, atol=1e-5)
        assert r["step1"]["loss"] == pytest.approx(single["step1"]["loss"], rel=1e-5, abs=1e-6)
        assert r["step1"]["grad_norm"] == pytest.approx(single["step1"]["grad_norm"], rel=1e-5)
        # other groupings round the gradients differently, and Adam's first step divides by |g|: the few
        # elements whose gradient is near zero move by up to the learning rate (1e-3) either way
        _assert_first_adam_step_close(r["weights1"], single["weights1"], TRAINER.lr)


def test_meta_init_ranks_receive_rank0s_weights_and_buffers(sharded, tiny_model_dir: Path) -> None:
    """Every rank builds the model on the meta device and only rank 0 reads the folder: the shards the
    ranks end up with are exactly the folder's weights, and the rotary buffers (outside the state dict)
    are rank 0's; the log-probs equal the unsharded model's (test above)."""
    from relax_models.loader import load_causal_lm

    model = load_causal_lm(str(tiny_model_dir))
    for rank in range(WORLD):
        loaded = sharded[rank]["loaded"]
        _assert_weights_equal(loaded["weights"], model.state_dict())
        buffers = dict(model.named_buffers())
        assert loaded["buffers"] and sorted(loaded["buffers"]) == sorted(buffers)
        for name, tensor in buffers.items():
            assert torch.equal(loaded["buffers"][name], tensor), name


def _assert_weights_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_each_rank_holds_half_the_parameters(sharded, single) -> None:
    full = sum(t.numel() for name, t in single["weights1"].items() if name != "lm_head.weight")
    for rank in range(WORLD):
        assert sharded[rank]["local_numel"] <= full // WORLD + 1024  # dim-0 shards, padded rows at most


def test_sharded_reference_scores_like_the_unsharded_model(sharded, single) -> None:
    """``build_backend(..., trainable=False, sharded=True)`` (the colocate Reference): half the weights per
    rank, no optimizer, the log-probs of the unsharded model loaded from the same folder; and it restores the
    model weights of a checkpoint saved with an optimizer (a Reference restarted in place loads its copy)."""
    full = sum(t.numel() for name, t in single["weights1"].items() if name != "lm_head.weight")
    for rank in range(WORLD):
        reference = sharded[rank]["reference"]
        assert reference["kind"] == "FSDPBackend" and reference["optimizer"] is None
        assert reference["local_numel"] <= full // WORLD + 1024
        torch.testing.assert_close(reference["logprobs"], single["logprobs"], rtol=1e-5, atol=1e-5)
        assert torch.equal(reference["logprobs"], sharded[rank]["logprobs"])  # the Actor's before training
        _assert_weights_equal(reference["restored"], sharded[rank]["weights1"])


def test_sharded_critic_fits_like_the_unsharded_critic(sharded, single) -> None:
    """The Critic of a colocate run with ``trainer.fsdp``: its value model sharded over the ranks, each
    fitting its slice of the batch, takes the step one unsharded Critic takes on the whole batch."""
    want = single["critic"]
    assert want["kind"] == "ValueBackend"
    assert want["fit2"]["critic/grad_norm"] > 0.5  # clipping was exercised
    assert (want["values3"] - want["values2"]).abs().max() > 1e-2  # the fits moved the values
    for rank in range(WORLD):
        got = sharded[rank]["critic"]
        assert got["kind"] == "ShardedValueBackend"
        assert got["local_numel"] <= want["local_numel"] // WORLD + 1024
        for step in (1, 2):
            torch.testing.assert_close(got[f"values{step}"], want[f"values{step}"], rtol=1e-5, atol=1e-6)
            for key in ("critic/vf_loss", "critic/grad_norm", "critic/values_mean"):
                assert got[f"fit{step}"][key] == pytest.approx(want[f"fit{step}"][key], rel=1e-5, abs=1e-7)
        # two updates at lr 1e-2 amplify fp32 summation-order differences to ~1e-5
        torch.testing.assert_close(got["values3"], want["values3"], rtol=1e-4, atol=1e-5)


@pytest.mark.gpu_twin
def test_bf16_shards_and_adamw_state_stay_fp32_under_a_bf16_forward(sharded) -> None:
    """``model.dtype=bfloat16`` (the GPU model configs): FSDP2's ``MixedPrecisionPolicy`` gathers the fp32
    shards in bf16 for the forward; the shards and AdamW state stay fp32 and take the whole lr-1e-6 step
    (Adam's first step moves each element by about lr); the weights go out to the engines in bf16."""
    for rank in range(WORLD):
        got = sharded[rank]["bf16"]
        assert got["shard_dtypes"] == got["state_dtypes"] == {torch.float32}
        assert got["forward_dtypes"] == {torch.bfloat16}
        assert got["moved"] > 0.9 and got["max_delta"] <= 1.2 * BF16_TRAINER.lr
        assert got["weight_dtypes"] == {torch.bfloat16}


def test_ranks_skip_a_non_finite_update_together(sharded) -> None:
    for rank in range(WORLD):
        got = sharded[rank]["nonfinite"]
        assert got["metrics"]["train/skipped_steps"] == 1.0 and got["unchanged"]
        assert math.isnan(got["metrics"]["loss"]) and math.isnan(got["metrics"]["grad_norm"])


def test_sharded_checkpoint_resumes_exactly(sharded) -> None:
    for rank in range(WORLD):
        r = sharded[rank]
        assert r["resumed_step2"] == r["step2"]
        for name, tensor in r["weights2"].items():
            assert torch.equal(r["resumed_weights2"][name], tensor), name
    ckpt = sharded["dir"] / "ckpt"
    assert sorted(p.name for p in ckpt.glob("fsdp_rank*.pt")) == ["fsdp_rank00000.pt", "fsdp_rank00001.pt"]
    assert len(list((ckpt / "dcp").glob("*.distcp"))) == WORLD


def test_weights_stream_in_bounded_buckets_of_full_tensors(sharded) -> None:
    r = sharded[0]
    assert sorted(r["bucket_names"]) == sorted(r["weights2"])
    assert len(r["bucket_sizes"]) > 1
    biggest = max(t.numel() * t.element_size() for t in r["weights2"].values())
    assert all(size <= max(40_000, biggest) for size in r["bucket_sizes"])


def test_hf_export_gathers_full_weights(sharded) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(sharded["dir"] / "export"))
    want = sharded[0]["weights2"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, want[name]), name


def test_lora_two_ranks_match_one_rank_and_resume_exactly(sharded, single) -> None:
    """``trainer.lora`` with FSDP: the sharded adapters take the unsharded backend's steps, the merged weights
    leave under the base names, and the adapter-only checkpoint resumes exactly."""
    want = single["lora"]
    assert sorted(want["weights2"]) == sorted(single["weights2"])  # the base model's names
    for rank in range(WORLD):
        got = sharded[rank]["lora"]
        for step in ("step1", "step2"):
            assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-5, abs=1e-6)
            assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=1e-5)
        _assert_weights_close(got["weights2"], want["weights2"])
        assert got["resumed_step2"] == got["step2"]
        _assert_weights_equal(got["resumed_weights2"], got["weights2"])


def test_lora_adapters_leave_in_peft_format(sharded, tiny_model_dir: Path) -> None:
    """The gathered adapters of the checkpoint (after step 1) and of the export (after step 2), merged by peft
    onto the base model, are the weights the backend published then."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    for folder, weights in (("lora_ckpt", "weights1"), ("lora_export", "weights2")):
        base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
        peft = PeftModel.from_pretrained(base, str(sharded["dir"] / folder / "adapter"))
        merged = peft.merge_and_unload().state_dict()
        want = sharded[0]["lora"][weights]
        _assert_weights_close({n: merged[n] for n in want}, want)
