"""LoRA on the torch backend (``trainer.lora``): merged weights, adapter-only training, exact resume, export."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from relax_core.backends.torch_backend import TorchBackend
from relax_core.config import LoRAConfig, ModelConfig, TrainerConfig
from relax_core.errors import RelaxUserError
from relax_core.samples import Sample, TrainBatch
from relax_models.loader import load_causal_lm
from relax_models.lora import LoRALinear, check_lora_config, is_adapter

LORA = TrainerConfig(
    lr=1e-2, lr_decay="cosine", total_steps=10, grad_clip=1.0, lora=LoRAConfig(rank=4, alpha=8)
)


def make_batch(tokenizer) -> TrainBatch:
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(6):
        prompt = tokenizer(f"sort {'3' * (i % 3 + 1)}{i}:", add_special_tokens=False).input_ids
        r = 2 + (i * 3) % 5
        response = torch.randint(3, len(tokenizer), (r,), generator=gen).tolist()
        samples.append(Sample(i // 2, i % 2, prompt, response, [0.0] * r, [1] * r))
    return TrainBatch.from_samples(samples, tokenizer.pad_token_id)


def nll_step(backend: TorchBackend, batch: TrainBatch) -> dict[str, float]:
    tokens = float(batch.loss_mask.sum())

    def loss_fn(mb, logprobs, entropy):
        return -(logprobs * mb.loss_mask).sum() / tokens, {}

    return backend.train_step(batch, loss_fn, micro_batch_size=4)


@pytest.fixture(scope="module")
def batch(tokenizer) -> TrainBatch:
    return make_batch(tokenizer)


def test_only_adapters_train_and_engines_get_base_plus_delta(tiny_model_dir: Path, batch: TrainBatch) -> None:
    lora = TorchBackend(str(tiny_model_dir), LORA, ModelConfig())
    base = load_causal_lm(str(tiny_model_dir), "float32", "sdpa").state_dict()
    nll_step(lora, batch)
    nll_step(lora, batch)

    adapters = {n: p for n, p in lora.model.named_parameters() if p.requires_grad}
    assert adapters and all(is_adapter(n) for n in adapters)
    assert len(adapters) == 2 * 4 * 7  # A and B on the 7 projections of each of the 4 layers
    optimized = [p for g in lora.optimizer.param_groups for p in g["params"]]
    assert {id(p) for p in optimized} == {id(p) for p in adapters.values()}
    assert set(lora.optimizer.state) == set(optimized)  # AdamW state for the adapters alone
    for name, p in lora.model.named_parameters():
        if not is_adapter(name):
            assert p.grad is None and torch.equal(p.cpu(), base[name]), name  # frozen and unchanged

    merged = lora.state_dict()
    assert {n: t.shape for n, t in merged.items()} == {n: t.shape for n, t in base.items()}
    layer = lora.model.model.layers[1].mlp.down_proj
    assert isinstance(layer, LoRALinear) and layer.lora_B.abs().max() > 0
    delta = layer.lora_B @ layer.lora_A * (8 / 4)
    name = "model.layers.1.mlp.down_proj.weight"
    torch.testing.assert_close(merged[name].cpu(), base[name] + delta.detach().cpu(), rtol=0, atol=1e-6)
    assert not torch.equal(merged[name].cpu(), base[name])
    # an engine (or the Reference) loading the merged weights into the plain model scores as the LoRA model
    plain = TorchBackend(str(tiny_model_dir), LORA, ModelConfig(), trainable=False)
    plain.load_state_dict(merged)
    torch.testing.assert_close(plain.forward_logprobs(batch), lora.forward_logprobs(batch), rtol=0, atol=1e-5)


def test_checkpoint_holds_adapters_and_resumes_exactly(
    tiny_model_dir: Path, batch: TrainBatch, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    run = TorchBackend(str(tiny_model_dir), LORA, ModelConfig())
    nll_step(run, batch)
    run.save_checkpoint(str(tmp_path / "ckpt"))
    want = nll_step(run, batch), run.state_dict()

    saved = torch.load(tmp_path / "ckpt" / "backend.pt", weights_only=False)
    assert saved["model"] and all(is_adapter(n) for n in saved["model"])
    torch.manual_seed(1)  # a different adapter init: the checkpoint's must win
    resumed = TorchBackend(str(tiny_model_dir), LORA, ModelConfig())
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    got = nll_step(resumed, batch), resumed.state_dict()
    assert got[0] == want[0]
    assert all(torch.equal(got[1][n], t) for n, t in want[1].items())

    full = TorchBackend(str(tiny_model_dir), replace(LORA, lora=LoRAConfig(rank=0)), ModelConfig())
    with pytest.raises(RelaxUserError, match="holds LoRA adapters; this run has trainer.lora.rank=0"):
        full.load_checkpoint(str(tmp_path / "ckpt"))


def test_export_writes_the_merged_model_the_loader_loads(
    tiny_model_dir: Path, batch: TrainBatch, tmp_path
) -> None:
    lora = TorchBackend(str(tiny_model_dir), LORA, ModelConfig())
    nll_step(lora, batch)
    lora.export_hf(str(tmp_path / "final_model"))
    exported = TorchBackend(str(tmp_path / "final_model"), LORA, ModelConfig(), trainable=False)
    assert not any(isinstance(m, LoRALinear) for m in exported.model.modules())
    torch.testing.assert_close(
        exported.forward_logprobs(batch), lora.forward_logprobs(batch), rtol=0, atol=1e-5
    )


def test_bad_lora_settings_stop_with_one_line(tiny_model_dir: Path) -> None:
    with pytest.raises(RelaxUserError, match="trainer.backend=megatron: use trainer=torch"):
        check_lora_config(LoRAConfig(rank=8), "megatron")
    with pytest.raises(RelaxUserError, match=r"trainer.lora.alpha must be > 0"):
        check_lora_config(LoRAConfig(rank=8, alpha=0), "torch")
    with pytest.raises(RelaxUserError, match=r"target_modules=\['qkv'\] matches no linear layer"):
        TorchBackend(
            str(tiny_model_dir), replace(LORA, lora=LoRAConfig(rank=2, target_modules=["qkv"])), ModelConfig()
        )


def test_full_warm_start_trains_the_base_then_adapters_and_resumes_with_that_base(
    tiny_model_dir: Path, batch: TrainBatch, tmp_path: Path
) -> None:
    trainer = replace(LORA, lora=LoRAConfig(rank=4, alpha=8, full_warm_start=True))
    run = TorchBackend(str(tiny_model_dir), trainer, ModelConfig())
    base = load_causal_lm(str(tiny_model_dir), "float32", "sdpa").state_dict()
    run.set_warm_start(True)
    run.reset_optimizer(1e-2)
    nll_step(run, batch)
    layer = run.model.model.layers[0].self_attn.q_proj
    assert not layer.lora_B.any()  # the warm-start moved the base only
    assert not torch.equal(layer.weight.cpu(), base["model.layers.0.self_attn.q_proj.weight"])
    run.set_warm_start(False)
    run.reset_optimizer(1e-2)
    assert all(is_adapter(n) == p.requires_grad for n, p in run.model.named_parameters())
    nll_step(run, batch)
    run.save_checkpoint(str(tmp_path / "ckpt"))
    want = nll_step(run, batch), run.state_dict()

    resumed = TorchBackend(
        str(tiny_model_dir), trainer, ModelConfig()
    )  # no warm-start: the checkpoint's base
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    got = nll_step(resumed, batch), resumed.state_dict()
    assert got[0] == want[0]
    assert all(torch.equal(got[1][n], t) for n, t in want[1].items())
