"""The fused decode kernels (``rollout.native_kernels=true``), compiled here with the machine's compiler: each
kernel against the eager ops it replaces, in fp32 and bf16, and the engine on them against plain full forwards
and against the eager engine's sampled tokens and log-probs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import greedy_loop, make_engine, reqs

from relax_core.engines.base import SamplingParams
from relax_core.engines.native_decode import decode_kernels
from relax_core.engines.torch_engine import TorchEngine, sample_tokens
from relax_core.errors import RelaxUserError


@pytest.fixture(scope="module")
def kernels():
    return decode_kernels()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_silu_mul_match_torch(kernels, dtype: torch.dtype) -> None:
    """Against torch's own ops in the same dtype (bf16: rounded where they round, so at most one bf16 step
    apart)."""
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-5}
    g = torch.Generator().manual_seed(0)
    x, w = (torch.randn(37, 96, generator=g) * 3).to(dtype), torch.randn(96, generator=g).to(dtype)
    ref = torch.nn.functional.rms_norm(x.float(), (96,), None, 1e-6).to(dtype) * w
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), ref, **tol)
    gate_up = torch.randn(37, 2 * 50, generator=g) * 4
    gate_up[0, :4] = torch.tensor([-120.0, -30.0, 30.0, 120.0])  # exp would overflow/underflow naively
    gate, up = gate_up.to(dtype).chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(kernels.silu_mul(gate_up.to(dtype)), ref, **tol)
    with pytest.raises(RuntimeError, match="w is Half: the kernels run float32 or bfloat16"):
        kernels.rms_norm(x, w.half(), 1e-6)


def test_sample_rows_picks_what_the_torch_sampler_picks(kernels) -> None:
    """The fused sampler against ``sample_tokens``' torch ops from the same uniforms: the same token on every
    row, log-probs equal to log-softmax, including rows whose mass sits on one token (the running sum reaches
    its total early, so a uniform near 1 must still pick that token, not one after it)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4096, 99, generator=g) * 4
    logits[:64, 7] = 200.0  # every other weight underflows to 0: the CDF is flat from token 7 on
    for temperature in (1.0, 0.6):
        sampling = SamplingParams(1, temperature=temperature)
        token, logp = sample_tokens(logits, sampling, torch.Generator().manual_seed(1), kernels)
        ref_token, ref_logp = sample_tokens(logits, sampling, torch.Generator().manual_seed(1))
        assert torch.equal(token, ref_token)
        assert (token[:64] == 7).all()
        torch.testing.assert_close(logp, ref_logp, rtol=0, atol=2e-5)
    uniforms = torch.tensor([0.0, 1 - 2**-24])  # the largest uniform torch.rand draws
    assert kernels.sample_rows(torch.tensor([[0.0, -200.0], [0.0, -200.0]]), uniforms)[0].tolist() == [0, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 32), (8, 8, 64), (16, 2, 128)])
def test_decode_attention_matches_the_eager_math(
    kernels, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    """q/k RMS norm, rotary, the cache write at each slot's position and softmax attention over 0..pos (rows
    before a shared length read from the shared slot), against the same steps written out in fp32 torch from
    the same inputs; cache rows other than the new positions stay untouched. In bf16 the new key row and the
    output are the fp32 results rounded once to bf16."""
    g = torch.Generator().manual_seed(heads)
    slots, rows, t_cap, eps = 7, 5, 40, 1e-6
    k_cache = torch.randn(slots, kv_heads, t_cap, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(slots, kv_heads, t_cap, head_dim, generator=g).to(dtype)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    lens = torch.tensor([0, 3, 17, 39, 8])
    # slot 3 reads its first 9 rows from slot 2, slot 4 its first 3 from slot 1, slot 2 5 rows of its own
    share_slots, share_lens = torch.tensor([0, 1, 2, 2, 1]), torch.tensor([0, 0, 5, 9, 3])
    angle = torch.randn(t_cap, head_dim, generator=g)
    cos, sin = angle.cos(), angle.sin()
    norm_w = torch.randn(heads + kv_heads, head_dim, generator=g)
    k_before, v_before = k_cache.clone(), v_cache.clone()

    out = kernels.decode_attention(
        qkv, k_cache, v_cache, lens, share_slots, share_lens, cos, sin, norm_w, eps, heads
    )

    heads_in = qkv[:, : (heads + kv_heads) * head_dim].float().view(rows, heads + kv_heads, head_dim)
    normed = torch.nn.functional.rms_norm(heads_in, (head_dim,), None, eps) * norm_w
    c, s = cos[lens].unsqueeze(1), sin[lens].unsqueeze(1)
    rotated = normed * c + normed.roll(head_dim // 2, -1) * s
    q, k_new = rotated[:, :heads], rotated[:, heads:]
    v_new = qkv[:, (heads + kv_heads) * head_dim :].view(rows, kv_heads, head_dim)
    expected_k, expected_v = k_before.clone(), v_before.clone()
    for r in range(rows):
        expected_k[r, :, lens[r]] = k_new[r].to(dtype)
        expected_v[r, :, lens[r]] = v_new[r]
    # bf16: one rounding step apart where the fp32 results sit near a rounding boundary
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-5}
    torch.testing.assert_close(k_cache, expected_k, **tol)
    torch.testing.assert_close(v_cache, expected_v, rtol=0, atol=0)
    expected_k, expected_v = expected_k.float(), expected_v.float()
    group = heads // kv_heads
    for r in range(rows):
        n, shared, m = int(lens[r]) + 1, int(share_slots[r]), int(share_lens[r])
        keys = torch.cat([expected_k[shared, :, :m], expected_k[r, :, m:n]], 1).repeat_interleave(group, 0)
        values = torch.cat([expected_v[shared, :, :m], expected_v[r, :, m:n]], 1).repeat_interleave(group, 0)
        probs = torch.softmax((keys @ q[r].unsqueeze(-1)).squeeze(-1), -1)
        ref = (probs.unsqueeze(-1) * values).sum(1).reshape(-1)
        tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-4}
        torch.testing.assert_close(out[r].float(), ref.to(dtype).float(), **tol)
    # slot 1 writes its position 3 in this call, so slot 4 may not read 4 rows of it
    with pytest.raises(RuntimeError, match="slot 4: shares 4 rows of slot 1"):
        kernels.decode_attention(
            qkv,
            k_cache,
            v_cache,
            lens,
            share_slots,
            torch.tensor([0, 0, 5, 9, 4]),
            cos,
            sin,
            norm_w,
            eps,
            heads,
        )


def test_native_engine_greedy_equals_full_forward(tiny_model_dir: Path, tokenizer, model) -> None:
    """Continuous batching (2 slots for 8 samples) on the kernels: every output is the plain forward's."""
    engine = make_engine(tiny_model_dir, tokenizer, max_running=2, native_kernels=True)
    requests = reqs(tokenizer)
    jobs = [
        engine.submit(r, SamplingParams(max_new_tokens=3 + 4 * i, temperature=0.0, n=2, ignore_eos=True))
        for i, r in enumerate(requests)
    ]
    engine.run_until(jobs)
    for i, (request, job) in enumerate(zip(requests, jobs)):
        expected = greedy_loop(model, request.input_ids, 3 + 4 * i)
        assert [result.output_ids for result in job.results] == [expected, expected]


def test_native_engine_samples_what_the_eager_engine_samples(tiny_model_dir: Path, tokenizer) -> None:
    """Same seed, same sampler draws: the tokens agree and the log-probs within float rounding."""
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0, n=8)
    eager = make_engine(tiny_model_dir, tokenizer, seed=3).generate(reqs(tokenizer), sampling)
    native = make_engine(tiny_model_dir, tokenizer, seed=3, native_kernels=True).generate(
        reqs(tokenizer), sampling
    )
    assert [r.output_ids for r in native] == [r.output_ids for r in eager]
    for a, b in zip(native, eager):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)


@torch.no_grad()
def test_native_bf16_log_probs_are_as_faithful_as_the_eager_bf16_ones(
    tiny_model_dir: Path, tokenizer, model
) -> None:
    """bf16 rounds at different places in the two paths, so their samples part after some tokens; what must
    hold is that the native path is as faithful: each engine's log-probs of its own samples against the fp32
    model's log-probs of those tokens (teacher forcing)."""
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0, n=8)
    errors = {}
    for native in (False, True):
        engine = make_engine(tiny_model_dir, tokenizer, seed=3, dtype=torch.bfloat16, native_kernels=native)
        requests = reqs(tokenizer)
        results = engine.generate(requests, sampling)
        diffs = []
        for i, result in enumerate(results):
            prompt = requests[i // sampling.n].input_ids
            logits = model(torch.tensor([prompt + result.output_ids])).logits[0, len(prompt) - 1 : -1]
            chosen = torch.tensor(result.output_ids).unsqueeze(-1)
            fp32 = torch.log_softmax(logits.float(), -1).gather(-1, chosen).squeeze(-1)
            diffs.append((torch.tensor(result.logprobs) - fp32).abs())
        errors[native] = torch.cat(diffs)
    assert errors[False].max() > 0  # bf16 does round: the comparison is not between two fp32 runs
    assert errors[True].max() < 0.05
    assert errors[True].mean() <= 2 * errors[False].mean()


def test_native_kernels_refuse_what_they_do_not_run(tiny_model_dir: Path, tokenizer) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with pytest.raises(RelaxUserError, match="fp32 or bf16 CPU decode.*float16"):
        make_engine(tiny_model_dir, tokenizer, dtype=torch.float16, native_kernels=True)
    odd_heads = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=64,
            hidden_size=96,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=48,
        )
    )
    with pytest.raises(RelaxUserError, match="head_dim \\(32, 64, 128\\).*head_dim 48"):
        TorchEngine(odd_heads, 0, [1], native_kernels=True)
