"""TorchBackend: micro-batch accumulation, checkpoints, HF export."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from relax_core.algorithms.objective import micro_batch_weight, policy_objective, sequence_count
from relax_core.backends import build_backend
from relax_core.backends.shared_prompts import prompt_groups
from relax_core.backends.torch_backend import TorchBackend
from relax_core.config.schema import AlgorithmConfig, ModelConfig, TrainerConfig
from relax_core.errors import RelaxUserError
from relax_core.samples import Sample, TrainBatch
from relax_models.loader import load_tokenizer

TRAINER = TrainerConfig(lr=1e-3, lr_decay="constant", grad_clip=1e6)


def make_batch(tokenizer, with_masked_row: bool = False) -> TrainBatch:
    """7 samples of varied prompt/response lengths, some tokens masked, advantages of both signs."""
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(7):
        prompt = tokenizer(f"sort {'3' * (i % 3 + 1)}{i}:", add_special_tokens=False).input_ids
        r = 2 + (i * 3) % 6
        response = torch.randint(3, len(tokenizer), (r,), generator=gen).tolist()
        mask = [1] * r
        if i % 3 == 1:
            mask[0] = 0  # e.g. an environment observation
        if with_masked_row and i == 4:
            mask = [0] * r  # e.g. a FAILED sample under failed_sample_policy=mask
        samples.append(Sample(i // 2, i % 2, prompt, response, [0.0] * r, mask, reward=float(i % 2)))
    batch = TrainBatch.from_samples(samples, tokenizer.pad_token_id)
    adv = torch.linspace(-1.0, 1.2, len(batch)).unsqueeze(1) * batch.loss_mask
    batch.extras["advantages"] = adv
    return batch


def objective_step(backend: TorchBackend, batch: TrainBatch, algo: AlgorithmConfig, micro: int) -> dict:
    """One optimizer step the way the Actor does it: per-micro-batch weights from the whole batch."""
    total_tokens, total_seqs = float(batch.loss_mask.sum()), sequence_count(batch, algo)

    def loss_fn(mb, logprobs, entropy):
        return policy_objective(
            mb, logprobs, entropy, algo, micro_batch_weight(mb, total_tokens, total_seqs, algo)
        )

    return backend.train_step(batch, loss_fn, micro)


@pytest.mark.parametrize(
    ("agg", "masked_row"),
    [
        ("token-mean", False),
        ("token-mean", True),
        ("seq-mean-token-mean", False),
        ("seq-mean-token-mean", True),
        ("seq-mean-token-sum", False),
        ("seq-mean-token-sum-norm", False),
    ],
)
def test_micro_batch_accumulation_equals_one_full_batch_step(
    tiny_model_dir: Path, tokenizer, agg: str, masked_row: bool
) -> None:
    algo = AlgorithmConfig(loss_agg_mode=agg, loss_scale=8.0, entropy_coef=0.01)
    batch = make_batch(tokenizer, masked_row)
    full = TorchBackend(str(tiny_model_dir), TRAINER, ModelConfig())
    split = TorchBackend(str(tiny_model_dir), TRAINER, ModelConfig())
    m_full = objective_step(full, batch, algo, micro=len(batch))
    m_split = objective_step(split, batch, algo, micro=2)  # 4 uneven micro-batches (2, 2, 2, 1)
    assert m_split["loss"] == pytest.approx(m_full["loss"], abs=1e-6)
    assert m_split["grad_norm"] == pytest.approx(m_full["grad_norm"], rel=1e-4)
    assert m_full["grad_norm"] > 0
    for (name, p_full), p_split in zip(full.model.named_parameters(), split.model.parameters(), strict=True):
        assert torch.allclose(p_full.grad, p_split.grad, atol=1e-6, rtol=1e-4), name


def test_train_step_changes_weights_and_reports_metrics(tiny_model_dir: Path, tokenizer) -> None:
    backend = build_backend("torch", str(tiny_model_dir), TRAINER, ModelConfig(), temperature=1.0, seed=0)
    before = backend.state_dict()
    batch = make_batch(tokenizer)
    metrics = objective_step(backend, batch, AlgorithmConfig(), micro=3)
    assert {"loss", "pg_loss", "entropy", "grad_norm", "lr"} <= set(metrics)
    assert metrics["lr"] == pytest.approx(1e-3)
    after = backend.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # state_dict is a copy (it is shipped to rollout engines): later steps do not mutate it
    snapshot = {k: v.clone() for k, v in after.items()}
    objective_step(backend, batch, AlgorithmConfig(), micro=3)
    assert all(torch.equal(after[k], snapshot[k]) for k in after)
    assert any(not torch.equal(after[k], v) for k, v in backend.state_dict().items())


def test_frozen_backend_has_no_optimizer(tiny_model_dir: Path, tokenizer) -> None:
    frozen = TorchBackend(str(tiny_model_dir), TRAINER, ModelConfig(), trainable=False)
    assert not any(p.requires_grad for p in frozen.model.parameters())
    logprobs = frozen.forward_logprobs(make_batch(tokenizer), micro_batch_size=3)
    assert logprobs.shape == make_batch(tokenizer).loss_mask.shape
    assert (logprobs <= 0).all()
    with pytest.raises(AssertionError):
        objective_step(frozen, make_batch(tokenizer), AlgorithmConfig(), micro=3)


def test_forward_logprobs_independent_of_micro_batch_size(tiny_model_dir: Path, tokenizer) -> None:
    backend = TorchBackend(str(tiny_model_dir), TRAINER, ModelConfig(), temperature=0.8, trainable=False)
    batch = make_batch(tokenizer)
    whole = backend.forward_logprobs(batch, micro_batch_size=64)
    pieces = backend.forward_logprobs(batch, micro_batch_size=2)
    assert whole.shape == pieces.shape == batch.loss_mask.shape
    assert torch.allclose(whole, pieces, atol=1e-5)


def grpo_batch(tokenizer, per_prompt: int = 4) -> TrainBatch:
    """4 prompts of different lengths x ``per_prompt`` samples, responses of 1..7 tokens (one an observation
    token), in shuffled row order, as GRPO's groups reach the Actor."""
    gen = torch.Generator().manual_seed(1)
    samples = []
    for g, text in enumerate(["sort 3:", "sort 91524:", "sort 407:", "sort 8812736:"]):
        prompt = tokenizer(text, add_special_tokens=False).input_ids
        for k in range(per_prompt):
            r = 1 + (g * 4 + k) % 7
            response = torch.randint(3, len(tokenizer), (r,), generator=gen).tolist()
            mask = [1] * r
            if r > 2 and k == 1:
                mask[1] = 0
            samples.append(Sample(g, k, prompt, response, [0.0] * r, mask, reward=float(k % 2)))
    order = torch.randperm(len(samples), generator=gen).tolist()
    batch = TrainBatch.from_samples([samples[i] for i in order], tokenizer.pad_token_id)
    batch.extras["advantages"] = torch.linspace(-1.0, 1.2, len(batch)).unsqueeze(1) * batch.loss_mask
    return batch


@pytest.mark.parametrize("micro", [16, 5])
def test_shared_prompts_give_the_plain_forwards_logprobs_and_gradients(
    tiny_model_dir: Path, tokenizer, micro: int
) -> None:
    """trainer.share_prompts runs each distinct prompt once and the responses on its KV cache: log-probs,
    entropy (at a rollout temperature), loss and every parameter gradient equal the plain forward's, also
    when micro-batches cut groups apart."""
    batch = grpo_batch(tokenizer)
    groups = prompt_groups(batch)
    assert groups is not None and len(groups[0]) == 4
    assert prompt_groups(make_batch(tokenizer)) is None  # 7 distinct prompts in 7 rows: the plain forward
    algo = AlgorithmConfig(entropy_coef=0.01)
    backends = {}
    for share in (False, True):
        cfg = replace(TRAINER, share_prompts=share)
        backends[share] = TorchBackend(str(tiny_model_dir), cfg, ModelConfig(), temperature=0.7)
    with torch.no_grad():
        plain, shared = (backends[s]._logprobs_entropy(batch) for s in (False, True))
    assert torch.allclose(shared[0], plain[0], atol=1e-5) and torch.allclose(shared[1], plain[1], atol=1e-5)
    assert plain[0].abs().sum() > 0
    m_plain, m_shared = (objective_step(backends[s], batch, algo, micro) for s in (False, True))
    assert m_shared["loss"] == pytest.approx(m_plain["loss"], rel=1e-5)
    assert m_shared["grad_norm"] == pytest.approx(m_plain["grad_norm"], rel=1e-4)
    named = zip(backends[False].model.named_parameters(), backends[True].model.parameters(), strict=True)
    for (name, p_plain), p_shared in named:
        assert torch.allclose(p_shared.grad, p_plain.grad, atol=1e-6, rtol=1e-4), name


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU determinism: CUDA's index backward sums with atomics, in any order"
)
def test_shared_prompts_gradients_are_bit_identical_call_to_call(tiny_model_dir: Path, tokenizer) -> None:
    """With two torch threads the shared path's gradients repeat bit for bit, so runs of one seed do too.
    (Copying the cache rows by advanced indexing did not: its backward sums a prompt's repeated rows in a
    thread-dependent order.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        backend = TorchBackend(str(tiny_model_dir), replace(TRAINER, share_prompts=True), ModelConfig())
        batch = grpo_batch(tokenizer, per_prompt=32)  # 128 rows, as a default step: enough to run in parallel
        grads = []
        for _ in range(6):
            backend.model.zero_grad(set_to_none=True)
            logprobs, _ = backend._logprobs_entropy(batch)
            (logprobs * batch.extras["advantages"]).sum().backward()
            grads.append(torch.cat([p.grad.flatten() for p in backend.model.parameters()]))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(g, grads[0]) for g in grads[1:])


def test_checkpoint_round_trip_restores_weights_and_optimizer(
    tiny_model_dir: Path, tokenizer, tmp_path: Path
) -> None:
    trainer = replace(TRAINER, lr_decay="cosine", total_steps=10, lr_warmup_steps=1)
    algo = AlgorithmConfig()
    batch = make_batch(tokenizer)
    a = TorchBackend(str(tiny_model_dir), trainer, ModelConfig())
    for _ in range(2):
        objective_step(a, batch, algo, micro=4)
    a.save_checkpoint(str(tmp_path / "ckpt"))
    b = TorchBackend(str(tiny_model_dir), trainer, ModelConfig())
    b.load_checkpoint(str(tmp_path / "ckpt"))
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    state_a, state_b = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert state_a.keys() == state_b.keys() and len(state_a) > 0
    for idx in state_a:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(state_a[idx][key]), torch.as_tensor(state_b[idx][key]))
    assert a.scheduler.get_last_lr() == b.scheduler.get_last_lr()
    # and the next step is the same on both: moments and schedule were restored, not re-initialised
    m_a, m_b = objective_step(a, batch, algo, micro=4), objective_step(b, batch, algo, micro=4)
    assert m_a["lr"] == m_b["lr"]
    for k, v in a.state_dict().items():
        assert torch.allclose(v, b.state_dict()[k], atol=1e-7), k
    fresh = TorchBackend(str(tiny_model_dir), trainer, ModelConfig())
    objective_step(fresh, batch, algo, micro=4)
    assert any(not torch.allclose(v, fresh.state_dict()[k]) for k, v in a.state_dict().items())


def test_export_hf_folder_loads_with_transformers(tiny_model_dir: Path, tokenizer, tmp_path: Path) -> None:
    backend = TorchBackend(str(tiny_model_dir), TRAINER, ModelConfig())
    batch = make_batch(tokenizer)
    objective_step(backend, batch, AlgorithmConfig(), micro=4)
    backend.export_hf(str(tmp_path / "hf"))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    backend.model.eval()
    with torch.no_grad():
        ids, mask = batch.input_ids.to(backend.device), batch.attention_mask.to(backend.device)
        expected = backend.model(input_ids=ids, attention_mask=mask).logits.cpu()
        got = loaded(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    assert torch.allclose(expected, got, atol=1e-5)
    exported_tok = load_tokenizer(str(tmp_path / "hf"))
    assert exported_tok("sort 12:").input_ids == tokenizer("sort 12:").input_ids
    assert exported_tok.eos_token_id == tokenizer.eos_token_id


def test_unknown_backend_is_a_user_error(tiny_model_dir: Path) -> None:
    with pytest.raises(RelaxUserError, match="trainer.backend='nope'"):
        build_backend("nope", str(tiny_model_dir), TRAINER, ModelConfig(), temperature=1.0, seed=0)


def test_iter_weights_streams_the_state_dict_in_bounded_buckets(tiny_model_dir: Path) -> None:
    from relax_core.runtime.placement import role_device

    backend = TorchBackend(str(tiny_model_dir), TRAINER, ModelConfig())
    assert backend.device == role_device()
    full = backend.state_dict()
    buckets = list(backend.iter_weights(bucket_bytes=50_000))
    assert len(buckets) > 1
    assert [name for b in buckets for name in b] == list(full)
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for t in bucket.values())
        assert size <= 50_000 or len(bucket) == 1  # a larger tensor travels alone
        assert all(torch.equal(t, full[name]) for name, t in bucket.items())


@pytest.mark.gpu_twin
def test_bf16_training_steps_fp32_master_weights_under_a_bf16_forward(
    tiny_model_dir: Path, tokenizer, tmp_path: Path
) -> None:
    """``model.dtype=bfloat16`` (the GPU model configs) at the recipes' lr of 1e-6: parameters and AdamW state
    stay fp32 and take the whole step (a bf16 parameter rounds it away), the forward computes in bf16, and
    the weights leave for the engines in bf16; a frozen scorer holds bf16 weights."""
    lr, bf16 = 1e-6, ModelConfig(dtype="bfloat16")
    backend = TorchBackend(str(tiny_model_dir), replace(TRAINER, lr=lr), bf16)
    assert {p.dtype for p in backend.model.parameters()} == {torch.float32}
    forward_dtypes: set[torch.dtype] = set()
    for module in backend.model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda _m, _i, out: forward_dtypes.add(out.dtype))
    before = {name: p.detach().clone() for name, p in backend.model.named_parameters()}
    objective_step(backend, make_batch(tokenizer), AlgorithmConfig(), micro=4)
    assert forward_dtypes == {torch.bfloat16}
    deltas = torch.cat(
        [(p.detach() - before[n]).abs().flatten() for n, p in backend.model.named_parameters()]
    )
    # Adam's first step moves every parameter with a gradient by lr (times |g| / (|g| + eps)), up to the
    # fp32 rounding of weights near 1 (the norms)
    assert (deltas > lr / 2).float().mean() > 0.9 and deltas.max() <= lr * 1.2
    state = [t for s in backend.optimizer.state.values() for k, t in s.items() if k != "step"]
    assert state and {t.dtype for t in state} == {torch.float32}
    weights = backend.state_dict()
    masters = backend.model.state_dict()
    assert all(torch.equal(w.cpu(), masters[n].to(torch.bfloat16).cpu()) for n, w in weights.items())
    # checkpoints keep the fp32 masters; an HF export is bf16 and says so
    backend.save_checkpoint(str(tmp_path / "ckpt"))
    resumed = TorchBackend(str(tiny_model_dir), replace(TRAINER, lr=lr), bf16)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert all(torch.equal(p.cpu(), masters[n].cpu()) for n, p in resumed.model.state_dict().items())
    backend.export_hf(str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype="auto")
    assert {p.dtype for p in exported.parameters()} == {torch.bfloat16}
    frozen = TorchBackend(str(tiny_model_dir), TRAINER, bf16, trainable=False)
    assert {p.dtype for p in frozen.model.parameters()} == {torch.bfloat16}
