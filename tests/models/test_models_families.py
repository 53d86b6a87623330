"""Model-family registry: modality checks, model_type lookup, batching of multimodal forward kwargs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from relax_core.errors import RelaxUserError
from relax_models.families import (
    FAMILIES,
    check_modality,
    decode_positions,
    family_for_model_type,
    forward_kwargs,
)


def test_registry_names_and_classes_exist() -> None:
    assert set(FAMILIES) == {"qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe", "qwen3_omni"}
    for spec in FAMILIES.values():
        assert spec.model_cls.__name__ == spec.model_class
        assert spec.config_cls.__name__ == spec.config_class
    assert FAMILIES["qwen3_omni"].model_class == "Qwen3OmniMoeThinkerForConditionalGeneration"


@pytest.mark.parametrize(
    ("family", "ok", "bad"),
    [
        ("qwen3", ["text"], ["vision", "image", "audio", "omni"]),
        ("qwen3_moe", ["text"], ["vision", "audio"]),
        ("qwen3_vl", ["text", "vision", "image", "video"], ["audio", "omni"]),
        ("qwen3_vl_moe", ["text", "vision", "video"], ["audio", "omni"]),
        ("qwen3_omni", ["text", "vision", "image", "video", "audio", "omni"], []),
    ],
)
def test_check_modality(family: str, ok: list[str], bad: list[str]) -> None:
    for modality in ok:
        check_modality(family, modality)
    for modality in bad:
        with pytest.raises(RelaxUserError, match=f"model family {family} cannot take modality '{modality}'"):
            check_modality(family, modality)


def test_check_modality_messages() -> None:
    with pytest.raises(RelaxUserError) as err:
        check_modality("qwen3", "vision")
    assert str(err.value) == "model family qwen3 cannot take modality 'vision'; choose one of ['text']"
    with pytest.raises(RelaxUserError, match="unknown model family 'llama'.*qwen3_omni"):
        check_modality("llama", "text")
    with pytest.raises(RelaxUserError, match="unknown modality 'smell'"):
        check_modality("qwen3_omni", "smell")


def test_family_for_model_type() -> None:
    assert family_for_model_type("qwen3") == "qwen3"
    assert family_for_model_type("qwen3_vl_moe") == "qwen3_vl_moe"
    assert family_for_model_type("qwen3_omni_moe") == "qwen3_omni"
    assert family_for_model_type("qwen3_omni_moe_thinker") == "qwen3_omni"
    with pytest.raises(RelaxUserError, match="no model family takes model_type 'llama'"):
        family_for_model_type("llama")


def _image(patches: int, grid: tuple[int, int, int], fill: float) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.full((patches, 8), fill), "image_grid_thw": torch.tensor([grid])}


def test_forward_kwargs_concatenates_images_in_row_order() -> None:
    a, b = _image(4, (1, 2, 2), 1.0), _image(8, (1, 2, 4), 2.0)
    config = SimpleNamespace(image_token_id=7, video_token_id=8)
    ids = torch.tensor([[5, 7, 5, 0], [7, 7, 5, 0], [5, 5, 5, 5]])
    kw = forward_kwargs("qwen3_vl", [a, b, None], input_ids=ids, config=config)
    assert set(kw) == {"pixel_values", "image_grid_thw", "mm_token_type_ids"}
    assert kw["pixel_values"].shape == (12, 8)
    assert kw["pixel_values"][:4].eq(1).all() and kw["pixel_values"][4:].eq(2).all()
    assert kw["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 4]]
    assert kw["mm_token_type_ids"].tolist() == [[0, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    # the same dict shared by two rows contributes once per row
    shared = forward_kwargs("qwen3_vl", [a, a], input_ids=ids[:2], config=config)
    assert shared["pixel_values"].shape == (8, 8)


def test_forward_kwargs_pads_audio_features() -> None:
    short = {
        "input_features": torch.ones(1, 4, 3),
        "feature_attention_mask": torch.ones(1, 3, dtype=torch.long),
    }
    long = {
        "input_features": torch.ones(1, 4, 5),
        "feature_attention_mask": torch.ones(1, 5, dtype=torch.long),
    }
    kw = forward_kwargs("qwen3_omni", [short, long])
    assert kw["input_features"].shape == (2, 4, 5)
    assert kw["input_features"][0, :, 3:].eq(0).all()
    assert kw["feature_attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert "mm_token_type_ids" not in kw


def test_forward_kwargs_rejects_what_the_family_cannot_take() -> None:
    image = _image(4, (1, 2, 2), 1.0)
    assert forward_kwargs("qwen3", [None, None]) == {}
    with pytest.raises(RelaxUserError, match="takes text only"):
        forward_kwargs("qwen3", [image])
    with pytest.raises(ValueError, match="does not take multimodal inputs \\['input_features'\\]"):
        forward_kwargs("qwen3_vl", {"input_features": torch.ones(1, 4, 3)})
    with pytest.raises(ValueError, match="needs input_ids and the model config"):
        forward_kwargs("qwen3_vl", image)


def test_decode_positions_shapes() -> None:
    nxt, delta = torch.tensor([5, 9]), torch.tensor([[-2], [0]])
    assert decode_positions("qwen3", nxt, torch.zeros(2, 1, dtype=torch.long)).tolist() == [[5], [9]]
    pos = decode_positions("qwen3_vl", nxt, delta)
    assert pos.shape == (3, 2, 1) and pos[:, :, 0].tolist() == [[3, 9]] * 3


TINY_DIMS = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}


def _files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_tiny_twin_is_built_once_per_recipe_and_copied_byte_for_byte(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RELAX_CACHE_DIR", str(tmp_path / "cache"))
    family = FAMILIES["qwen3"]
    first = family.build_tiny(tmp_path / "run1" / "model_init", seed=1, **TINY_DIMS)
    second = family.build_tiny(tmp_path / "run2" / "model_init", seed=1, **TINY_DIMS)
    cached = list((tmp_path / "cache" / "tiny_models").iterdir())
    assert [p.name.startswith("qwen3-") for p in cached] == [True]  # one build, no scratch folder left
    # the copies are the build a launch without a cache makes in place
    direct = family._build_tiny(tmp_path / "direct", 1, TINY_DIMS)
    assert _files(first) == _files(second) == _files(direct) == _files(cached[0])
    other_seed = family.build_tiny(tmp_path / "run3" / "model_init", seed=2, **TINY_DIMS)
    assert len(list((tmp_path / "cache" / "tiny_models").iterdir())) == 2
    assert _files(other_seed)["model.safetensors"] != _files(first)["model.safetensors"]


def test_tiny_twin_without_a_writable_cache_is_built_in_place(tmp_path, monkeypatch) -> None:
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    monkeypatch.setenv("RELAX_CACHE_DIR", str(blocker))
    folder = FAMILIES["qwen3"].build_tiny(tmp_path / "model_init", seed=1, **TINY_DIMS)
    assert (folder / "model.safetensors").is_file() and (folder / "relax_tiny.json").is_file()
