"""The rollout engine through its interface (``build_engine`` + ``RolloutEngine``), pinned against plain
full-forward decoding and the training backend's log-probs, so any faster implementation must agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relax_core.algorithms.logprobs import token_logprobs_and_entropy
from relax_core.config.schema import ModelConfig, TrainerConfig
from relax_core.engines import build_engine
from relax_core.engines.base import GenerationRequest, GenerationResult, RolloutEngine, SamplingParams
from relax_core.errors import RelaxUserError
from relax_core.samples import Sample, TrainBatch
from relax_models.loader import load_causal_lm
from relax_models.tiny import build_tiny_qwen3

PROMPTS = ["sort 31524:", "sort 9:", "sort 8080:", "hello there, sort 123:"]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tokenizer) -> RolloutEngine:
    eng = build_engine("torch", str(tiny_model_dir), tokenizer, ModelConfig(), seed=5)
    assert isinstance(eng, RolloutEngine)
    yield eng
    eng.shutdown()


def requests(tokenizer, prompts: list[str] = PROMPTS) -> list[GenerationRequest]:
    return [
        GenerationRequest(tokenizer(p, add_special_tokens=False).input_ids, request_id=f"r{i}")
        for i, p in enumerate(prompts)
    ]


@torch.no_grad()
def reference_greedy(
    model, prompt_ids: list[int], max_new: int, stop: set[int]
) -> tuple[list[int], list[float]]:
    """Argmax decoding by re-running the full sequence each step (no cache, no batching)."""
    ids, logps = list(prompt_ids), []
    for _ in range(max_new):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        token = int(logits.argmax())
        logps.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
        if token in stop:
            break
    return ids[len(prompt_ids) :], logps


def test_greedy_equals_full_forward_argmax(engine, model, tokenizer) -> None:
    reqs = requests(tokenizer)
    results = engine.generate(reqs, SamplingParams(max_new_tokens=10, temperature=0.0))
    assert len(results) == len(reqs)
    for req, res in zip(reqs, results, strict=True):
        assert isinstance(res, GenerationResult) and res.request_id == req.request_id
        tokens, logps = reference_greedy(model, req.input_ids, 10, {tokenizer.eos_token_id})
        assert res.output_ids == tokens
        assert res.logprobs == pytest.approx(logps, abs=1e-4)
        assert res.finish_reason == ("stop" if tokens[-1] == tokenizer.eos_token_id else "length")
    assert engine.generate([], SamplingParams()) == []


def test_stop_tokens_and_length_budget(engine, model, tokenizer) -> None:
    req = requests(tokenizer)[0]
    free, _ = reference_greedy(model, req.input_ids, 8, {tokenizer.eos_token_id})
    assert len(free) >= 4, "the random-init tiny model should not emit EOS in its first tokens"
    stop_token = free[2]
    cut = free.index(stop_token) + 1
    (res,) = engine.generate(
        [req], SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=[stop_token])
    )
    assert res.finish_reason == "stop"
    assert res.output_ids == free[:cut]  # the stop token is part of the response
    assert len(res.logprobs) == cut
    (short,) = engine.generate([req], SamplingParams(max_new_tokens=3, temperature=0.0))
    assert short.finish_reason == "length" and short.output_ids == free[:3]
    # sampled too: every response ends on its budget or on a stop token, never later
    sampled = engine.generate(
        requests(tokenizer), SamplingParams(max_new_tokens=5, n=4, stop_token_ids=[stop_token])
    )
    for r in sampled:
        assert 1 <= len(r.output_ids) <= 5 and len(r.logprobs) == len(r.output_ids)
        stops = {stop_token, tokenizer.eos_token_id}
        if r.finish_reason == "stop":
            assert r.output_ids[-1] in stops and not stops & set(r.output_ids[:-1])
        else:
            assert r.finish_reason == "length" and len(r.output_ids) == 5
            assert not stops & set(r.output_ids)


def test_n_samples_are_grouped_request_major(engine, tokenizer) -> None:
    reqs = requests(tokenizer)[:3]
    results = engine.generate(reqs, SamplingParams(max_new_tokens=6, n=3, temperature=1.0))
    assert [r.request_id for r in results] == ["r0"] * 3 + ["r1"] * 3 + ["r2"] * 3
    # greedy n>1: all samples of a request are the same continuation, in request order
    greedy = engine.generate(reqs, SamplingParams(max_new_tokens=6, n=2, temperature=0.0))
    single = engine.generate(reqs, SamplingParams(max_new_tokens=6, temperature=0.0))
    for i, res in enumerate(single):
        assert greedy[2 * i].output_ids == greedy[2 * i + 1].output_ids == res.output_ids


def test_top_k_one_equals_greedy(engine, tokenizer) -> None:
    reqs = requests(tokenizer)
    greedy = engine.generate(reqs, SamplingParams(max_new_tokens=8, temperature=0.0))
    top1 = engine.generate(reqs, SamplingParams(max_new_tokens=8, temperature=1.0, top_k=1, n=2))
    for i, g in enumerate(greedy):
        assert top1[2 * i].output_ids == top1[2 * i + 1].output_ids == g.output_ids


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k"), [(1.0, 1.0, -1), (0.7, 1.0, -1), (1.3, 0.9, -1), (1.0, 1.0, 5)]
)
def test_sampled_logprobs_match_the_training_backend(
    engine, tiny_model_dir: Path, tokenizer, temperature: float, top_p: float, top_k: int
) -> None:
    """Rollout log-probs are log softmax(z/T) of the sampled token before top-p/top-k truncation."""
    from relax_core.backends.torch_backend import TorchBackend

    reqs = requests(tokenizer)
    sampling = SamplingParams(max_new_tokens=8, temperature=temperature, top_p=top_p, top_k=top_k, n=3)
    results = engine.generate(reqs, sampling)
    samples = [
        Sample(i // 3, i % 3, reqs[i // 3].input_ids, r.output_ids, r.logprobs, [1] * len(r.output_ids))
        for i, r in enumerate(results)
    ]
    batch = TrainBatch.from_samples(samples, tokenizer.pad_token_id)
    backend = TorchBackend(
        str(tiny_model_dir), TrainerConfig(), ModelConfig(), temperature=temperature, trainable=False
    )
    trained = backend.forward_logprobs(batch)
    assert torch.allclose(trained, batch.rollout_logprobs, atol=1e-4), (
        (trained - batch.rollout_logprobs).abs().max()
    )
    # the same numbers straight from the shared log-prob function on a plain forward
    with torch.no_grad():
        ids, mask = batch.input_ids.to(backend.device), batch.attention_mask.to(backend.device)
        logits = backend.model(input_ids=ids, attention_mask=mask).logits.cpu()
    direct, _ = token_logprobs_and_entropy(logits, batch, temperature)
    assert torch.allclose(direct, batch.rollout_logprobs, atol=1e-4)
    if top_k == 5:  # only top-5 tokens may be drawn
        with torch.no_grad():
            pos_logits = logits.gather(
                1,
                (batch.prompt_lens.unsqueeze(1) + torch.arange(batch.loss_mask.shape[1]) - 1)
                .clamp(min=0)
                .unsqueeze(-1)
                .expand(-1, -1, logits.shape[-1]),
            )
        for i, s in enumerate(samples):
            for j, tok in enumerate(s.response_ids):
                assert tok in pos_logits[i, j].topk(5).indices.tolist()


def test_same_seed_same_samples(tiny_model_dir: Path, tokenizer) -> None:
    reqs = requests(tokenizer)[:2]
    sampling = SamplingParams(max_new_tokens=8, n=4)
    a = build_engine("torch", str(tiny_model_dir), tokenizer, ModelConfig(), seed=11).generate(reqs, sampling)
    b = build_engine("torch", str(tiny_model_dir), tokenizer, ModelConfig(), seed=11).generate(reqs, sampling)
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    assert len({tuple(r.output_ids) for r in a}) > 2  # and sampling is not degenerate


def test_update_weights_switches_policy_and_version(
    tiny_model_dir: Path, tokenizer, tmp_path: Path, tiny_dims: dict
) -> None:
    other_dir = build_tiny_qwen3(tmp_path / "other", seed=99, **tiny_dims)
    other = load_causal_lm(str(other_dir)).eval()
    eng = build_engine("torch", str(tiny_model_dir), tokenizer, ModelConfig(), seed=1)
    reqs = requests(tokenizer)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    before = eng.generate(reqs, greedy)
    assert all(r.weight_version == 0 for r in before)
    eng.update_weights({k: v.clone() for k, v in other.state_dict().items()}, version=3)
    after = eng.generate(reqs, greedy)
    assert all(r.weight_version == 3 for r in after)
    expected = [reference_greedy(other, r.input_ids, 8, {tokenizer.eos_token_id})[0] for r in reqs]
    assert [r.output_ids for r in after] == expected
    assert [r.output_ids for r in before] != expected


def test_unknown_engine_is_a_user_error(tiny_model_dir: Path, tokenizer) -> None:
    with pytest.raises(RelaxUserError, match="rollout.engine='nope'"):
        build_engine("nope", str(tiny_model_dir), tokenizer, ModelConfig(), seed=0)
