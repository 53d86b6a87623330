"""Tiny twins: build, save, reload with transformers' Auto classes, and run forwards with their modalities."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from models_media import random_image, write_wav
from PIL import Image
from transformers import (
    AutoConfig,
    AutoFeatureExtractor,
    AutoImageProcessor,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForMultimodalLM,
    AutoTokenizer,
)

from relax_models.families import FAMILIES, decode_positions, forward_kwargs, rope_positions
from relax_models.loader import KV_CACHE_KEY
from relax_models.processors import build_multimodal_inputs, load_processor
from relax_models.tiny_multimodal import build_tiny_qwen3_vl

AUTO = {
    "qwen3_moe": (AutoModelForCausalLM, "Qwen3MoeForCausalLM"),
    "qwen3_vl": (AutoModelForImageTextToText, "Qwen3VLForConditionalGeneration"),
    "qwen3_vl_moe": (AutoModelForImageTextToText, "Qwen3VLMoeForConditionalGeneration"),
    "qwen3_omni": (AutoModelForMultimodalLM, "Qwen3OmniMoeForConditionalGeneration"),
}
MODEL_TYPES = {"qwen3_moe": "qwen3_moe", "qwen3_vl": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl_moe"}
MODEL_TYPES["qwen3_omni"] = "qwen3_omni_moe"


@pytest.mark.parametrize("family", list(AUTO))
def test_twin_folder_reloads_with_auto_classes(tiny_folders: dict[str, Path], family: str) -> None:
    folder = tiny_folders[family]
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    assert AutoConfig.from_pretrained(folder).model_type == MODEL_TYPES[family]
    auto_cls, class_name = AUTO[family]
    model = auto_cls.from_pretrained(folder)
    assert type(model).__name__ == class_name
    assert sum(p.numel() for p in model.parameters()) < 400_000
    trained = FAMILIES[family].load(folder)
    assert type(trained).__name__ == FAMILIES[family].model_class
    # the trainable part holds the very weights the Auto class loaded
    reference = model.thinker if family == "qwen3_omni" else model
    for (name, a), (_, b) in zip(reference.state_dict().items(), trained.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    if family == "qwen3_moe":
        assert "mlp.experts" in "".join(n for n, _ in trained.named_parameters())


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe", "qwen3_omni"])
def test_processor_parts_reload_with_auto_classes(tiny_folders: dict[str, Path], family: str) -> None:
    folder = tiny_folders[family]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = AutoConfig.from_pretrained(folder)
    vision = config.thinker_config if family == "qwen3_omni" else config
    assert tokenizer.image_token_id == vision.image_token_id
    assert tokenizer.convert_tokens_to_ids("<|video_pad|>") == vision.video_token_id
    assert tokenizer("5").input_ids == [tokenizer.convert_tokens_to_ids("5")]
    image_processor = AutoImageProcessor.from_pretrained(folder)
    assert (image_processor.patch_size, image_processor.merge_size) == (16, 2)
    processor_config = json.loads((folder / "processor_config.json").read_text())
    assert processor_config["processor_class"] == FAMILIES[family].processor_class
    if family == "qwen3_omni":
        assert tokenizer.audio_token_id == vision.audio_token_id
        assert AutoFeatureExtractor.from_pretrained(folder).feature_size == 128
    proc = load_processor(folder)
    assert proc.family == family and proc.factor == 32


@pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is None, reason="transformers' video processors need torchvision"
)
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_omni"])
def test_auto_processor_loads_folder(tiny_folders: dict[str, Path], family: str) -> None:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_folders[family])
    assert type(processor).__name__ == FAMILIES[family].processor_class


def test_build_is_idempotent(tmp_path: Path) -> None:
    folder = build_tiny_qwen3_vl(tmp_path / "vl", seed=1, num_hidden_layers=1)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_qwen3_vl(tmp_path / "vl", seed=1, num_hidden_layers=1) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    build_tiny_qwen3_vl(tmp_path / "vl", seed=2, num_hidden_layers=1)
    assert (folder / "model.safetensors").stat().st_mtime_ns != stamp


def _prompts(family: str, folder: Path, tmp_path: Path) -> list[tuple[list[int], dict | None]]:
    """Two prompts of different lengths: (image [+ audio]), and a different image (or text only)."""
    proc = load_processor(folder)
    first_text, second_text = "see <image> ok", "two <image>"
    audios: list = []
    if family == "qwen3_omni":
        first_text += " hear <audio>"
        audios = [write_wav(tmp_path / "a.wav", 1.3, 44100)]
    first = build_multimodal_inputs(proc, first_text, images=[random_image(64, 96, 1)], audios=audios)
    second = build_multimodal_inputs(proc, second_text, images=[random_image(96, 64, 2)])
    return [first, second]


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe", "qwen3_omni"])
def test_forward_with_modality_and_batch_parity(
    tiny_folders: dict[str, Path], family: str, tmp_path: Path
) -> None:
    """A right-padded batch (as the trainer builds it) gives each row the logits it gets alone."""
    model = FAMILIES[family].load(tiny_folders[family]).eval()
    prompts = _prompts(family, tiny_folders[family], tmp_path)
    vocab = model.config.get_text_config().vocab_size
    singles = []
    for ids, mm in prompts:
        x = torch.tensor([ids])
        kw = forward_kwargs(family, mm, input_ids=x, config=model.config)
        with torch.no_grad():
            logits = model(input_ids=x, attention_mask=torch.ones_like(x), **kw).logits
        assert logits.shape == (1, len(ids), vocab) and torch.isfinite(logits).all()
        singles.append(logits[0])
    width = max(len(ids) for ids, _ in prompts)
    batch = torch.zeros((2, width), dtype=torch.long)
    mask = torch.zeros_like(batch)
    for i, (ids, _) in enumerate(prompts):
        batch[i, : len(ids)], mask[i, : len(ids)] = torch.tensor(ids), 1
    kw = forward_kwargs(family, [mm for _, mm in prompts], input_ids=batch, config=model.config)
    with torch.no_grad():
        logits = model(input_ids=batch, attention_mask=mask, **kw).logits
    for i, (ids, _) in enumerate(prompts):
        torch.testing.assert_close(logits[i, : len(ids)], singles[i], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_omni"])
def test_cached_decode_matches_full_forward(
    tiny_folders: dict[str, Path], family: str, tmp_path: Path
) -> None:
    """Left-padded prefill with M-RoPE positions, then one cached decode step, as a rollout engine runs it."""
    model = FAMILIES[family].load(tiny_folders[family]).eval()
    prompts = _prompts(family, tiny_folders[family], tmp_path)
    width = max(len(ids) for ids, _ in prompts)
    batch = torch.zeros((2, width), dtype=torch.long)
    mask = torch.zeros_like(batch)
    for i, (ids, _) in enumerate(prompts):
        batch[i, width - len(ids) :], mask[i, width - len(ids) :] = torch.tensor(ids), 1
    kw = forward_kwargs(family, [mm for _, mm in prompts], input_ids=batch, config=model.config)
    positions, deltas = rope_positions(family, model, batch, mask, kw)
    assert positions.shape == (3, 2, width)
    new = torch.tensor([[11], [12]])
    with torch.no_grad():
        out = model(input_ids=batch, attention_mask=mask, position_ids=positions, use_cache=True, **kw)
        step = model(
            input_ids=new,
            attention_mask=torch.cat([mask, torch.ones_like(new)], 1),
            position_ids=decode_positions(family, mask.sum(-1), deltas),
            use_cache=True,
            **{KV_CACHE_KEY: getattr(out, KV_CACHE_KEY)},
        ).logits[:, -1]
    for i, (ids, mm) in enumerate(prompts):
        full = torch.tensor([ids + new[i].tolist()])
        row_kw = forward_kwargs(family, mm, input_ids=full, config=model.config)
        with torch.no_grad():
            expected = model(input_ids=full, attention_mask=torch.ones_like(full), **row_kw).logits[0, -1]
        torch.testing.assert_close(step[i], expected, atol=1e-4, rtol=1e-4)


def test_image_changes_logits(tiny_folders: dict[str, Path]) -> None:
    """The vision tower is really wired in: another image changes the text logits after it."""
    model = FAMILIES["qwen3_vl"].load(tiny_folders["qwen3_vl"]).eval()
    proc = load_processor(tiny_folders["qwen3_vl"])
    outs = []
    for seed in (1, 2):
        ids, mm = build_multimodal_inputs(
            proc, "<image>done", images=[Image.fromarray(random_image(64, 64, seed))]
        )
        x = torch.tensor([ids])
        with torch.no_grad():
            outs.append(
                model(input_ids=x, **forward_kwargs("qwen3_vl", mm, input_ids=x, config=model.config)).logits
            )
    assert not np.allclose(outs[0][0, -1].numpy(), outs[1][0, -1].numpy(), atol=1e-5)


def test_omni_thinker_loads_from_a_full_checkpoint(tmp_path: Path) -> None:
    """A folder with talker and code2wav weights (a released checkpoint's layout) yields just the thinker."""
    from relax_models.tiny_multimodal import build_tiny_qwen3_omni

    folder = build_tiny_qwen3_omni(tmp_path / "full", seed=5, talker=True)
    full = AutoModelForMultimodalLM.from_pretrained(folder)
    names = [n for n, _ in full.named_parameters()]
    assert any(n.startswith("talker.") for n in names) and any(n.startswith("code2wav.") for n in names)
    thinker = FAMILIES["qwen3_omni"].load(folder)
    assert type(thinker).__name__ == "Qwen3OmniMoeThinkerForConditionalGeneration"
    expected = full.thinker.state_dict()
    assert thinker.state_dict().keys() == expected.keys()
    assert all(torch.equal(expected[k], v) for k, v in thinker.state_dict().items())
