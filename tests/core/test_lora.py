"""LoRA through peft on the torch backend (``trainer.lora``): merged weights, adapter-only training at
``lr_scale`` x lr, exact resume from peft-format adapters, and a ``final_model/adapter`` that
``PeftModel.from_pretrained`` loads."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from transformers import AutoModelForCausalLM

from relax_core.backends.torch_backend import TorchBackend
from relax_core.config.schema import LoRAConfig, ModelConfig, TrainerConfig
from relax_core.errors import RelaxUserError
from relax_core.run_loop import RunLoop
from relax_core.samples import Sample, TrainBatch
from relax_models.loader import load_causal_lm
from relax_models.lora import check_lora_config, is_adapter, peft_names

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


def logits(model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits


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
    assert lora.optimizer.param_groups[0]["initial_lr"] == pytest.approx(LORA.lr * LORA.lora.lr_scale)
    peft_base = peft_names(base, lora.lora_scales)
    for name, p in lora.model.named_parameters():
        if not is_adapter(name):
            assert p.grad is None and torch.equal(p.cpu(), peft_base[name]), name  # frozen and unchanged

    merged = lora.state_dict()
    assert {n: t.shape for n, t in merged.items()} == {n: t.shape for n, t in base.items()}
    layer = lora.model.model.layers[1].mlp.down_proj
    assert isinstance(layer, LoraLayer)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    assert b.abs().max() > 0
    name = "model.layers.1.mlp.down_proj.weight"
    torch.testing.assert_close(merged[name], base[name] + (b @ a * (8 / 4)).detach(), rtol=0, atol=1e-6)
    # an engine (or the Reference) loading the merged weights into the plain model scores as the LoRA model
    plain = TorchBackend(str(tiny_model_dir), LORA, ModelConfig(), trainable=False)
    plain.load_state_dict(merged)
    torch.testing.assert_close(plain.forward_logprobs(batch), lora.forward_logprobs(batch), rtol=0, atol=1e-5)


def test_checkpoint_holds_peft_adapters_and_resumes_exactly(
    tiny_model_dir: Path, batch: TrainBatch, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    run = TorchBackend(str(tiny_model_dir), LORA, ModelConfig())
    nll_step(run, batch)
    run.save_checkpoint(str(tmp_path / "ckpt"))
    want = nll_step(run, batch), run.state_dict()

    saved = torch.load(tmp_path / "ckpt" / "backend.pt", weights_only=False)
    assert saved["model"] == {}  # the frozen base is model_path; the adapters are in peft's folder
    config = json.loads((tmp_path / "ckpt" / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    torch.manual_seed(1)  # a different adapter init: the checkpoint's must win
    resumed = TorchBackend(str(tiny_model_dir), LORA, ModelConfig())
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    got = nll_step(resumed, batch), resumed.state_dict()
    assert got[0] == want[0]
    assert all(torch.equal(got[1][n], t) for n, t in want[1].items())

    full = TorchBackend(str(tiny_model_dir), replace(LORA, lora=LoRAConfig(rank=0)), ModelConfig())
    with pytest.raises(RelaxUserError, match="holds LoRA adapters; this run has trainer.lora.rank=0"):
        full.load_checkpoint(str(tmp_path / "ckpt"))
    fewer = replace(LORA, lora=LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "gate_proj"]))
    with pytest.raises(RelaxUserError, match="adapters do not match this run.s .*_proj"):
        TorchBackend(str(tiny_model_dir), fewer, ModelConfig()).load_checkpoint(str(tmp_path / "ckpt"))


def test_export_writes_the_merged_model_and_a_peft_adapter_on_the_base(
    tiny_model_dir: Path, batch: TrainBatch, tmp_path: Path
) -> None:
    lora = TorchBackend(str(tiny_model_dir), LORA, ModelConfig())
    nll_step(lora, batch)
    lora.export_hf(str(tmp_path / "final_model"))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final_model"))
    assert not any(isinstance(m, LoraLayer) for m in merged.modules())
    torch.testing.assert_close(logits(merged, batch), logits(lora.model, batch), rtol=0, atol=1e-5)
    adapter = tmp_path / "final_model" / "adapter"
    base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base == str(tiny_model_dir)  # adapters only from the start: the base is model.path
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(adapter))
    torch.testing.assert_close(logits(peft, batch), logits(merged, batch), rtol=0, atol=1e-5)


def test_dropout_only_on_the_training_forward(tiny_model_dir: Path, batch: TrainBatch) -> None:
    run = TorchBackend(
        str(tiny_model_dir), replace(LORA, lora=LoRAConfig(rank=4, dropout=0.5)), ModelConfig()
    )
    nll_step(run, batch)  # B != 0: dropout on A's input changes the output
    assert run.model.training
    assert torch.equal(run.forward_logprobs(batch), run.forward_logprobs(batch))  # scoring: deterministic
    inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
    assert not torch.equal(run.model(**inputs).logits, run.model(**inputs).logits)


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
    assert run.optimizer.param_groups[0]["lr"] == 1e-2  # the full model trains at the lr given
    nll_step(run, batch)
    layer = run.model.model.layers[0].self_attn.q_proj
    assert not layer.lora_B["default"].weight.any()  # the warm-start moved the base only
    assert not torch.equal(layer.base_layer.weight, base["model.layers.0.self_attn.q_proj.weight"])
    run.set_warm_start(False)
    run.reset_optimizer(1e-2)
    assert all(is_adapter(n) == p.requires_grad for n, p in run.model.named_parameters())
    nll_step(run, batch)
    run.save_checkpoint(str(tmp_path / "ckpt"))
    want = nll_step(run, batch), run.state_dict()

    # no warm-start: the checkpoint's base
    resumed = TorchBackend(str(tiny_model_dir), trainer, ModelConfig())
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    got = nll_step(resumed, batch), resumed.state_dict()
    assert got[0] == want[0]
    assert all(torch.equal(got[1][n], t) for n, t in want[1].items())


def test_a_run_writes_an_adapter_peft_loads_onto_its_base_as_the_merged_final_model(
    make_cfg, tiny_model_dir: Path, tmp_path: Path, batch: TrainBatch
) -> None:
    """``trainer.lora.rank`` alone: the warm-start trains the full model, so ``final_model/adapter`` names the
    warm-started base it wrote (``adapter/base``); peft on that base gives ``final_model``'s logits."""
    cfg = make_cfg(
        "cluster=in_process",
        "logger=jsonl",
        f"model.path={tiny_model_dir}",
        "trainer.lora.rank=4",
        "trainer.total_steps=2",
        "trainer.sft_warmup_steps=2",
        "trainer.sft_batch_size=16",
        "trainer.eval_every=0",
        "eval.sets.heldout.greedy=false",
        "eval.sets.heldout.n_samples=0",
        "rollout.max_new_tokens=4",
    )
    RunLoop(cfg, {}).run()
    adapter = tmp_path / "final_model" / "adapter"
    base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert Path(base) == adapter.resolve() / "base"
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(adapter))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final_model"))
    torch.testing.assert_close(logits(peft, batch), logits(merged, batch), rtol=0, atol=1e-5)
    assert not torch.allclose(logits(peft.get_base_model(), batch), logits(merged, batch))  # RL moved B


def test_adapter_payload_merges_to_the_published_weights_and_marks_base_changes(
    tiny_model_dir: Path, batch: TrainBatch, tmp_path: Path
) -> None:
    """trainer.lora.engine_sync=adapter: a published version is the base, the adapters under peft's saved names
    and the base's version; merged it equals the merged weights, its base version moves only with the base (the
    full-model warm-start), and its adapters written as a folder load in peft."""
    from relax_models.lora import PEFT_PREFIX, adapter_folder, merged_payload, split_payload

    cfg = replace(LORA, lora=LoRAConfig(rank=4, alpha=8, full_warm_start=True))
    backend = TorchBackend(str(tiny_model_dir), cfg, ModelConfig())
    backend.engine_adapters = True
    nll_step(backend, batch)  # B != 0
    payload = backend.publish_weights()
    base, adapters, version, scale = split_payload(payload)
    assert (
        scale == 2.0
        and all(k.startswith(PEFT_PREFIX) for k in adapters)
        and set(base) == set(backend.state_dict())
    )
    merged = merged_payload(payload)
    assert merged.keys() == backend.state_dict().keys()
    assert all(torch.allclose(merged[k], v, atol=1e-6) for k, v in backend.state_dict().items())
    nll_step(backend, batch)
    assert split_payload(backend.publish_weights())[2] == version  # adapters only: the base did not move
    backend.set_warm_start(True)  # the base trains: every version may carry a new one
    first = split_payload(backend.publish_weights())[2]
    assert first > version and split_payload(backend.publish_weights())[2] > first
    backend.set_warm_start(False)
    after = split_payload(backend.publish_weights())[2]
    assert split_payload(backend.publish_weights())[2] == after
    assert backend.state_dict().keys() == merged.keys()  # export and the Reference keep the merged weights
    # the receivers that take merged weights (ActorFwd, Reference) load a payload as its merge
    follower = TorchBackend(str(tiny_model_dir), LORA, ModelConfig(), trainable=False)
    follower.load_state_dict(payload)
    assert all(torch.allclose(follower.state_dict()[k], v, atol=1e-6) for k, v in merged.items())
    # the folder an adapter engine loads (vLLM's LoRARequest) is one peft loads onto the base
    folder = tmp_path / "adapter"
    assert adapter_folder(folder, adapters, scale) == sum(t.numel() * 4 for t in adapters.values())
    base_model = load_causal_lm(str(tiny_model_dir), "float32", "sdpa", family="qwen3")
    base_model.load_state_dict(base, strict=False)
    peft_model = PeftModel.from_pretrained(base_model, str(folder))
    merged_model = load_causal_lm(str(tiny_model_dir), "float32", "sdpa", family="qwen3")
    merged_model.load_state_dict(merged, strict=False)
    assert torch.allclose(logits(peft_model, batch), logits(merged_model, batch), atol=1e-5)


def test_engine_sync_settings_that_cannot_work_stop_with_one_line() -> None:
    from relax_models.lora import check_engine_sync

    with pytest.raises(RelaxUserError, match="engine_sync must be merged or adapter"):
        check_engine_sync(LoRAConfig(rank=8, engine_sync="both"), 512)
    with pytest.raises(RelaxUserError, match="serves LoRA ranks up to 512.*engine_sync=merged"):
        check_engine_sync(LoRAConfig(rank=1024, engine_sync="adapter"), 512)
    # an engine without LoRA gets merged weights anyway
    check_engine_sync(LoRAConfig(rank=1024, engine_sync="adapter"), None)
    check_engine_sync(LoRAConfig(rank=1024), 512)  # merged, the default
