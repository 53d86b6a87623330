"""The torch engine's fast path (slot KV cache, continuous batching) pinned against plain full forwards and
the training backend's log-probs; the static multimodal path against a full-forward greedy loop."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_helpers import check_ignore_eos, greedy_loop, make_engine, reqs
from PIL import Image

from relax_core.algorithms.logprobs import token_logprobs_and_entropy
from relax_core.engines.base import GenerationRequest, SamplingParams
from relax_core.engines.torch_engine import TorchEngine, filter_logits, sample_tokens
from relax_core.errors import RelaxUserError
from relax_core.samples import Sample, TrainBatch


def test_engine_logprobs_match_training_recomputation(tiny_model_dir: Path, tokenizer, model) -> None:
    """Sampled tokens' log-probs equal token_logprobs_and_entropy on the same tokens (fp32, T=0.7, top-k/p)."""
    engine = make_engine(tiny_model_dir, tokenizer, seed=1)
    requests = reqs(tokenizer)
    sampling = SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9, top_k=20, n=3)
    results = engine.generate(requests, sampling)
    assert len(results) == len(requests) * 3
    samples = [
        Sample(i // 3, i % 3, requests[i // 3].input_ids, r.output_ids, r.logprobs, [1] * len(r.output_ids))
        for i, r in enumerate(results)
    ]
    batch = TrainBatch.from_samples(samples, tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    expected, _ = token_logprobs_and_entropy(logits, batch, temperature=0.7)
    torch.testing.assert_close(batch.rollout_logprobs, expected, atol=2e-5, rtol=0)
    # the n samples of one prompt really are sampled independently
    assert len({tuple(r.output_ids) for r in results[:3]}) > 1


def test_greedy_equals_full_forward_with_continuous_batching(tiny_model_dir: Path, tokenizer, model) -> None:
    """With 4 slots and 8 samples waiting, finished rows free slots for queued ones; outputs stay exact."""
    engine = make_engine(tiny_model_dir, tokenizer, max_running=4)
    requests = reqs(tokenizer)
    jobs = [  # every row runs to its own budget
        engine.submit(r, SamplingParams(max_new_tokens=3 + 4 * i, temperature=0.0, n=2, ignore_eos=True))
        for i, r in enumerate(requests)
    ]
    engine.run_until(jobs)
    assert engine.peak_running == 4
    for i, (request, job) in enumerate(zip(requests, jobs)):
        expected = greedy_loop(model, request.input_ids, 3 + 4 * i)
        for result in job.results:
            assert result.output_ids == expected
            assert result.finish_reason == "length"


def _run_tracking_cache(engine: TorchEngine, jobs: list) -> int:
    """Step ``engine`` until ``jobs`` are done; the most tokens its K/V tensors held at any step."""
    peak = 0
    while engine.step():
        k, _ = engine._cache  # [layers, slots, kv_heads, T, head_dim]
        peak = max(peak, k.shape[1] * k.shape[3])
    assert all(job.done.is_set() for job in jobs)
    return peak


def test_kv_cache_token_budget_queues_requests_and_keeps_greedy_outputs(
    tiny_model_dir: Path, tokenizer
) -> None:
    """rollout.kv_cache_tokens: the cache never holds more tokens than the budget, requests beyond it wait in
    the queue, and greedy generations equal those of an engine without a budget."""
    requests = reqs(tokenizer)
    sampling = [
        SamplingParams(3 + 4 * i, temperature=0.0, n=2, ignore_eos=True) for i in range(len(requests))
    ]
    budget = max(2 * (len(r.input_ids) + s.max_new_tokens) for r, s in zip(requests, sampling))
    outputs, peaks = [], []
    for kv_cache_tokens in (None, budget):
        engine = make_engine(tiny_model_dir, tokenizer, kv_cache_tokens=kv_cache_tokens)
        jobs = [engine.submit(r, s) for r, s in zip(requests, sampling)]
        tokens = _run_tracking_cache(engine, jobs)
        outputs.append([[r.output_ids for r in job.results] for job in jobs])
        peaks.append((tokens, engine.peak_running))
    (free_tokens, free_running), (bounded_tokens, bounded_running) = peaks
    assert free_tokens > budget and free_running == 2 * len(requests)  # the budget binds
    assert bounded_tokens <= budget and bounded_running < free_running
    assert outputs[0] == outputs[1]
    assert [len(ids) for ids in outputs[1][3]] == [15, 15]


def test_request_beyond_the_kv_cache_budget_is_refused_in_one_line(tiny_model_dir: Path, tokenizer) -> None:
    """A request whose n samples can never fit the budget is refused, naming the setting; nothing of the call
    stays queued and the engine serves the next call."""
    short, long = reqs(tokenizer, ["x", "hello there, sort 8080:"])
    engine = make_engine(tiny_model_dir, tokenizer, kv_cache_tokens=40)
    sampling = SamplingParams(8, temperature=0.0, n=2)
    with pytest.raises(RelaxUserError) as err:
        engine.generate([short, long], sampling)
    message = str(err.value)
    assert "\n" not in message and "rollout.kv_cache_tokens=40" in message and "'r1'" in message, message
    assert not engine.has_work()
    assert len(engine.generate([short], sampling)) == 2


def test_release_memory_frees_the_cache_and_keeps_generations(tiny_model_dir: Path, tokenizer) -> None:
    """rollout.release_memory_during_train: between two generations the KV cache and decode buffers are
    gone; the second generation re-creates them and samples what an engine that kept them samples."""
    requests, sampling = reqs(tokenizer), SamplingParams(6, temperature=1.0, n=3)
    kept, released = (make_engine(tiny_model_dir, tokenizer, seed=4) for _ in range(2))
    first = [engine.generate(requests, sampling) for engine in (kept, released)]
    assert first[0] == first[1] and released.cache_bytes() > 0
    released.release_memory()
    assert released.cache_bytes() == 0 and released._rotary is None and released._slots.tokens.numel() == 0
    second = [engine.generate(requests, sampling) for engine in (kept, released)]
    assert second[0] == second[1] and released.cache_bytes() > 0


def test_stop_token_and_stop_string(tiny_model_dir: Path, tokenizer, model) -> None:
    engine = make_engine(tiny_model_dir, tokenizer)
    request = reqs(tokenizer)[0]
    free = greedy_loop(model, request.input_ids, 8)
    greedy = SamplingParams(8, temperature=0.0, ignore_eos=True)
    [by_id] = engine.generate([request], dataclasses.replace(greedy, stop_token_ids=[free[2]]))
    cut = free.index(free[2]) + 1
    assert by_id.output_ids == free[:cut] and by_id.finish_reason == "stop"
    text = tokenizer.decode(free[3:5])
    [by_text] = engine.generate([request], dataclasses.replace(greedy, stop_strings=[text]))
    assert by_text.finish_reason == "stop" and text in tokenizer.decode(by_text.output_ids)
    assert len(by_text.output_ids) <= 5


def test_rows_of_different_sampling_configs_keep_their_own_stops_and_budgets(
    tiny_model_dir: Path, tokenizer, model
) -> None:
    """Greedy and sampled jobs, with and without a stop id, decode in the same steps: each row stops on its
    own stop ids and budget only."""
    engine = make_engine(tiny_model_dir, tokenizer)
    a, b = reqs(tokenizer)[:2]
    free_a = greedy_loop(model, a.input_ids, 10)
    jobs = [
        engine.submit(a, SamplingParams(10, temperature=0.0, stop_token_ids=[free_a[4]], ignore_eos=True)),
        engine.submit(b, SamplingParams(6, temperature=1.0, n=3, ignore_eos=True)),
        engine.submit(b, SamplingParams(9, temperature=0.0, ignore_eos=True)),
    ]
    engine.run_until(jobs)
    [stopped], sampled, [greedy] = (job.results for job in jobs)
    assert stopped.output_ids == free_a[: free_a.index(free_a[4]) + 1] and stopped.finish_reason == "stop"
    assert [(len(r.output_ids), len(r.logprobs), r.finish_reason) for r in sampled] == [(6, 6, "length")] * 3
    assert greedy.output_ids == greedy_loop(model, b.input_ids, 9) and greedy.finish_reason == "length"


def test_ignore_eos_is_per_request(tiny_model_dir: Path, tokenizer) -> None:
    """In one batch, rows that honour EOS stop at it and rows that ignore it draw it and run on."""
    engine = make_engine(tiny_model_dir, tokenizer)
    request = reqs(tokenizer)[0]
    sampling = SamplingParams(60, n=8)
    free, fixed = (
        engine.submit(request, s) for s in (sampling, dataclasses.replace(sampling, ignore_eos=True))
    )
    engine.run_until([free, fixed])
    check_ignore_eos(free.results, fixed.results, tokenizer.eos_token_id, budget=60)


def test_abort_returns_partial_results(tiny_model_dir: Path, tokenizer) -> None:
    engine = make_engine(tiny_model_dir, tokenizer)
    out = {}
    big = [GenerationRequest(tokenizer("sort 1:").input_ids, "a")]
    sampling = SamplingParams(200, n=4, ignore_eos=True)
    worker = threading.Thread(target=lambda: out.update(r=engine.generate(big, sampling)))
    worker.start()
    while engine.peak_running == 0:
        time.sleep(0.01)
    engine.abort()
    worker.join(timeout=60)
    assert [r.finish_reason for r in out["r"]] == ["abort"] * 4
    assert all(len(r.output_ids) < 200 for r in out["r"])


def test_abort_by_request_id_leaves_other_requests_running(tiny_model_dir: Path, tokenizer) -> None:
    engine = make_engine(tiny_model_dir, tokenizer)
    requests = [GenerationRequest(tokenizer("sort 1:").input_ids, rid) for rid in ("keep", "stop")]
    out = {}
    sampling = SamplingParams(120, n=2, ignore_eos=True)
    worker = threading.Thread(target=lambda: out.update(r=engine.generate(requests, sampling)))
    worker.start()
    while engine.peak_running == 0:
        time.sleep(0.01)
    engine.abort(["stop"])
    worker.join(timeout=120)
    by_id = {(r.request_id, r.finish_reason, len(r.output_ids) == 120) for r in out["r"]}
    assert by_id == {("keep", "length", True), ("stop", "abort", False)}


def test_weight_update_changes_outputs(tiny_model_dir: Path, tokenizer, model) -> None:
    engine = make_engine(tiny_model_dir, tokenizer)
    request = reqs(tokenizer)[:1]
    before = engine.generate(request, SamplingParams(6, temperature=0.0))[0]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = torch.randn_like(state["lm_head.weight"])
    engine.update_weights(state, version=7)
    after = engine.generate(request, SamplingParams(6, temperature=0.0))[0]
    assert after.weight_version == 7 and before.weight_version == 0
    assert after.logprobs != before.logprobs


def test_filter_logits_top_k_top_p() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert torch.isinf(filter_logits(logits, 2, 1.0)[0, 2:]).all()
    probs = logits.softmax(-1)[0]  # 0.64, 0.24, 0.09, 0.03
    kept = torch.isfinite(filter_logits(logits, -1, float(probs[0] + 0.01))[0])
    assert kept.tolist() == [True, True, False, False]
    # a top_p float32 rounds to 0 (an HTTP body may send 5e-324) keeps the top token and samples it
    kept = filter_logits(logits, -1, 5e-324)[0]
    assert torch.isfinite(kept).tolist() == [True, False, False, False]
    token, _ = sample_tokens(logits, SamplingParams(1, top_p=5e-324), torch.Generator().manual_seed(0))
    assert token.tolist() == [0]


def test_sampled_frequencies_follow_the_filtered_distribution() -> None:
    """20k draws from one row: frequencies match softmax(z/T) after top-k, and log-probs are unfiltered."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]]).expand(20_000, -1)
    generator = torch.Generator().manual_seed(0)
    sampling = SamplingParams(1, temperature=0.8, top_k=3)
    token, logp = sample_tokens(logits, sampling, generator)
    expected = (logits[0, :3] / 0.8).softmax(-1)
    freq = torch.bincount(token, minlength=4).float() / len(token)
    assert freq[3] == 0
    torch.testing.assert_close(freq[:3], expected, atol=0.015, rtol=0)
    torch.testing.assert_close(logp, torch.log_softmax(logits / 0.8, -1).gather(-1, token[:, None])[:, 0])


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="bf16 matmul needs oneDNN")
def test_bfloat16_engine_runs(tiny_model_dir: Path, tokenizer, model) -> None:
    """bf16 compute gives valid tokens whose log-probs are close to the fp32 recomputation."""
    engine = make_engine(tiny_model_dir, tokenizer, dtype=torch.bfloat16)
    requests = reqs(tokenizer)
    results = engine.generate(requests, SamplingParams(6, temperature=0.0))
    for request, result in zip(requests, results):
        assert len(result.output_ids) >= 1
        with torch.no_grad():
            ids = torch.tensor([request.input_ids + result.output_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        first = float(logp[len(request.input_ids) - 1, result.output_ids[0]])
        assert abs(first - result.logprobs[0]) < 0.1


def test_multimodal_vl_greedy_equals_full_forward(tmp_path: Path) -> None:
    """Qwen3-VL twin: prefill with pixel kwargs + M-RoPE, decode with decode_positions = full-forward loop."""
    from relax_models.families import FAMILIES, forward_kwargs
    from relax_models.loader import load_tokenizer
    from relax_models.processors import build_multimodal_inputs, load_processor
    from relax_models.tiny_multimodal import build_tiny_qwen3_vl

    folder = build_tiny_qwen3_vl(tmp_path / "vl", seed=3)
    model = FAMILIES["qwen3_vl"].load(folder).eval()
    tokenizer = load_tokenizer(str(folder))
    proc = load_processor(folder)
    rng = np.random.default_rng(0)
    prompts = []
    for i, (h, w) in enumerate([(64, 96), (96, 64)]):
        image = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
        prompts.append(
            build_multimodal_inputs(proc, "see <image> ok" if i == 0 else "two <image>", images=[image])
        )
    engine = TorchEngine(model, tokenizer.pad_token_id, [], tokenizer=tokenizer, family="qwen3_vl")
    requests = [GenerationRequest(ids, f"m{i}", mm) for i, (ids, mm) in enumerate(prompts)]
    results = engine.generate(requests, SamplingParams(5, temperature=0.0))
    for (ids, mm), result in zip(prompts, results):
        expected = greedy_loop(
            model, ids, 5, lambda x, mm=mm: forward_kwargs("qwen3_vl", mm, input_ids=x, config=model.config)
        )
        assert result.output_ids == expected
