"""The torch training backend on multimodal batches: the log-probs it computes for right-padded rows with
pixel/audio inputs are the ones the rollout engine sampled with, and an optimizer step trains the towers."""

from __future__ import annotations

import pytest
import torch
from multimodal_twins import tiny_model_cfg

from relax_core.backends.torch_backend import TorchBackend
from relax_core.config.schema import TrainerConfig
from relax_core.data.multimodal import MediaPrompts, multimodal_model_inputs, placeholder_token_ids
from relax_core.data.prompts import PromptStream, load_prompts
from relax_core.engines.base import GenerationRequest, SamplingParams
from relax_core.engines.torch_engine import TorchEngine
from relax_core.samples import Sample, TrainBatch
from relax_models.loader import load_causal_lm, load_tokenizer


def _rollout(t: dict, family: str, prompts: int = 3, n: int = 4) -> tuple[list[Sample], object]:
    tokenizer = load_tokenizer(t["path"])
    media = MediaPrompts.from_config(t["modality"], t["path"])
    records, _ = load_prompts(t["train"], t["data"], tokenizer, media)
    drawn = media.materialize(PromptStream(records, seed=2).next_batch(prompts))
    engine = TorchEngine(
        load_causal_lm(t["path"], family=family),
        tokenizer.pad_token_id,
        [tokenizer.eos_token_id],
        seed=0,
        tokenizer=tokenizer,
        family=family,
    )
    requests = [GenerationRequest(p.prompt_ids, str(p.index), p.multimodal_inputs) for p in drawn]
    results = engine.generate(requests, SamplingParams(max_new_tokens=5, n=n))
    samples = [
        Sample(
            drawn[j // n].index,
            j % n,
            drawn[j // n].prompt_ids,
            r.output_ids,
            r.logprobs,
            [1] * len(r.output_ids),
            multimodal_inputs=drawn[j // n].multimodal_inputs,
        )
        for j, r in enumerate(results)
    ]
    return samples, tokenizer


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_omni"])
def test_training_logprobs_match_rollout_and_a_step_trains_the_tower(twins, family: str) -> None:
    samples, tokenizer = _rollout(twins[family], family)
    batch = TrainBatch.from_samples(samples, tokenizer.pad_token_id)
    backend = TorchBackend(twins[family]["path"], TrainerConfig(lr=1e-2), tiny_model_cfg(family))
    placeholders = torch.tensor(placeholder_token_ids(backend.model.config))
    # a random-init policy samples placeholder tokens now and then: those rows see a pad in training
    clean = torch.tensor([not torch.isin(torch.tensor(s.response_ids), placeholders).any() for s in samples])
    assert clean.sum() >= len(samples) // 2
    logprobs = backend.forward_logprobs(batch, micro_batch_size=5)
    diff = ((logprobs - batch.rollout_logprobs).abs() * batch.loss_mask)[clean]
    assert float(diff.max()) < 1e-4
    tower = "visual" if family == "qwen3_vl" else "audio_tower"
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters() if f"{tower}." in n}
    assert before

    def nll(micro, lp, entropy):
        return -(lp * micro.loss_mask).sum() / batch.loss_mask.sum(), {}

    metrics = backend.train_step(batch, nll, micro_batch_size=6)
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["grad_norm"] > 0
    after = dict(backend.model.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before), f"{tower} got no update"


def test_sampled_placeholder_tokens_do_not_break_training(twins) -> None:
    """A response holding an image placeholder has no pixels behind it: fed as pad, scored as sampled."""
    samples, tokenizer = _rollout(twins["qwen3_vl"], "qwen3_vl", prompts=2, n=1)
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    samples[0].response_ids = [image_pad, 7, image_pad]
    samples[0].rollout_logprobs, samples[0].loss_mask = [0.0] * 3, [1] * 3
    batch = TrainBatch.from_samples(samples, tokenizer.pad_token_id)
    backend = TorchBackend(twins["qwen3_vl"]["path"], TrainerConfig(), tiny_model_cfg("qwen3_vl"))
    input_ids, kwargs = multimodal_model_inputs("qwen3_vl", backend.model, batch)
    prompt_len = len(samples[0].prompt_ids)
    assert (input_ids[0, prompt_len:] == image_pad).sum() == 0
    assert torch.equal(input_ids[0, :prompt_len], batch.input_ids[0, :prompt_len])
    assert int((kwargs["mm_token_type_ids"] == 1).sum()) == 8  # 2 prompts x 4 image tokens
    logprobs = backend.forward_logprobs(batch)
    assert torch.isfinite(logprobs).all()
