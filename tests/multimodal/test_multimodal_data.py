"""Multimodal datasets: synthetic tasks whose answer is in the media, loading with media references, building
tensors when a prompt is drawn, and the n samples of a prompt sharing them (also across a Ray call)."""

from __future__ import annotations

import json
import string
from pathlib import Path

import numpy as np
import pytest
import ray
import soundfile
import torch
from PIL import Image
from tiers import heavy

from relax_core.config.schema import DataConfig, ModalityConfig
from relax_core.data.multimodal import MediaPrompts, check_modality_keys
from relax_core.data.prompts import PromptStream, load_prompts
from relax_core.data.synthetic_multimodal import COLORS, TONES_HZ
from relax_core.errors import RelaxUserError
from relax_core.samples import Sample, TrainBatch
from relax_models.loader import load_tokenizer
from relax_models.processors import multimodal_nbytes


def _rows(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_vision_colors_answer_is_the_colour_in_the_image(twins) -> None:
    train = _rows(twins["qwen3_vl"]["train"])
    assert len(train) == 48 and {r["label"] for r in train} == set("ABCD")
    for row in train[:24]:
        assert row["prompt"].startswith("<image>") and row["images"][0].startswith("media/")
        image = np.asarray(Image.open(Path(twins["qwen3_vl"]["train"]).parent / row["images"][0]))
        assert image.shape == (64, 64, 3)
        # the square is the one uniform region: its shade is the most frequent pixel value
        values, counts = np.unique(image.reshape(-1, 3), axis=0, return_counts=True)
        shade = values[counts.argmax()].astype(int)
        choices = row["metadata"]["choices"]
        nearest = min(choices, key=lambda c: np.abs(shade - np.asarray(COLORS[c])).sum())
        assert string.ascii_uppercase[choices.index(nearest)] == row["label"]


def test_audio_tones_answer_is_the_pitch_of_the_clip(twins) -> None:
    rows = _rows(twins["qwen3_omni"]["eval"])
    assert len(rows) == 16 and len({r["label"] for r in rows}) > 1
    for row in rows:
        wave, rate = soundfile.read(Path(twins["qwen3_omni"]["eval"]).parent / row["audios"][0])
        assert rate == 16000 and len(wave) == 8000
        spectrum = np.abs(np.fft.rfft(wave))
        peak = np.fft.rfftfreq(len(wave), 1 / rate)[spectrum.argmax()]
        nearest = min(range(4), key=lambda i: abs(np.log(peak / TONES_HZ[i])))
        assert string.ascii_uppercase[nearest] == row["label"]


def test_eval_rows_never_occur_in_train(twins) -> None:
    for family in twins:
        train, eval_ = _rows(twins[family]["train"]), _rows(twins[family]["eval"])
        # media files differ per row; the content key is not stored, so compare the media bytes
        folder = Path(twins[family]["train"]).parent
        column = "images" if family == "qwen3_vl" else "audios"
        train_bytes = {(folder / r[column][0]).read_bytes() for r in train}
        assert not any((folder / r[column][0]).read_bytes() in train_bytes for r in eval_)


def test_records_hold_media_references_and_expanded_ids(twins) -> None:
    t = twins["qwen3_vl"]
    tokenizer = load_tokenizer(t["path"])
    media = MediaPrompts.from_config(t["modality"], t["path"])
    records, skipped = load_prompts(t["train"], t["data"], tokenizer, media)
    assert skipped == 0 and len(records) == 48
    first = records[0]
    assert first.multimodal_inputs is None and Path(first.media["image"][0]).is_absolute()
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    # 64x64 px, 16-px patches, 2x2 merge -> 4 LLM tokens per image
    assert first.prompt_ids.count(pad) == 4
    drawn = media.materialize(records[:3])
    assert records[0].multimodal_inputs is None  # the stored record keeps references only
    assert drawn[0].prompt_ids == first.prompt_ids
    assert drawn[0].multimodal_inputs["pixel_values"].shape == (16, 3 * 2 * 16 * 16)
    assert drawn[0].multimodal_inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
    # a text-only run gets no processor
    assert MediaPrompts.from_config(ModalityConfig(), t["path"]) is None


def test_relative_paths_lists_and_bad_rows(twins, tmp_path: Path) -> None:
    t = twins["qwen3_vl"]
    (tmp_path / "imgs").mkdir()
    Image.fromarray(np.zeros((40, 80, 3), np.uint8)).save(tmp_path / "imgs" / "a.png")
    rows = [
        {"prompt": "<image> and <image>?", "label": "A", "images": ["imgs/a.png", "imgs/a.png"]},
        {"prompt": "no media here", "label": "B", "images": None},
        {"prompt": "<image>?", "label": "C", "images": "imgs/missing.png"},
        {"prompt": "<image>?", "label": "D"},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = load_tokenizer(t["path"])
    # a null column switches a kind off: the rows need no "videos" column
    modality = ModalityConfig(name="vision", keys={"image": "images", "video": None})
    media = MediaPrompts.from_config(modality, t["path"])
    cfg = DataConfig(name="jsonl", synthetic=None, train_path=str(path), on_error="raise")
    with pytest.raises(RelaxUserError, match=r"row 2: image file .*imgs/missing.png' does not exist"):
        load_prompts(str(path), cfg, tokenizer, media)
    cfg.on_error = "skip"
    records, skipped = load_prompts(str(path), cfg, tokenizer, media)
    assert skipped == 2 and [r.label for r in records] == ["A", "B"]
    assert records[0].media == {"image": [str(tmp_path / "imgs" / "a.png")] * 2}
    assert records[1].media is None
    both = media.materialize(records)
    assert both[0].multimodal_inputs["image_grid_thw"].shape == (2, 3) and both[1].multimodal_inputs is None


def test_modality_keys_are_checked() -> None:
    check_modality_keys(ModalityConfig(name="omni", keys={"image": "i", "video": "v", "audio": "a"}))
    check_modality_keys(ModalityConfig(name="vision", keys={"image": "i", "audio": None}))  # switched off
    with pytest.raises(RelaxUserError, match="modality 'vision' takes no audio inputs"):
        check_modality_keys(ModalityConfig(name="vision", keys={"audio": "audios"}))
    with pytest.raises(RelaxUserError, match="'pictures' is not an input kind"):
        check_modality_keys(ModalityConfig(name="vision", keys={"pictures": "images"}))


@pytest.fixture
@heavy("starts a local Ray")
def ray_local():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@ray.remote(num_cpus=0.1)
def _storage_bytes(batch: TrainBatch) -> tuple[int, int]:
    """What the receiving side of a Ray call holds: tensor bytes (shared counted once), distinct dicts."""
    return multimodal_nbytes([batch.multimodal_inputs]), len({id(m) for m in batch.multimodal_inputs})


def test_samples_of_a_prompt_share_tensors_through_ray(twins, ray_local) -> None:
    t = twins["qwen3_omni"]
    tokenizer = load_tokenizer(t["path"])
    media = MediaPrompts.from_config(t["modality"], t["path"])
    records, _ = load_prompts(t["train"], t["data"], tokenizer, media)
    prompts = media.materialize(PromptStream(records, seed=1).next_batch(2))
    n = 8
    samples = [
        Sample(p.index, i, p.prompt_ids, [5, 6], [0.0, 0.0], [1, 1], multimodal_inputs=p.multimodal_inputs)
        for p in prompts
        for i in range(n)
    ]
    per_prompt = multimodal_nbytes([p.multimodal_inputs for p in prompts])
    assert per_prompt > 0 and multimodal_nbytes(samples) == per_prompt
    # a Ray round trip (what rollout -> driver does) keeps one dict per prompt
    back = ray.get(ray.put(samples))
    assert len({id(s.multimodal_inputs) for s in back}) == 2
    assert multimodal_nbytes(back) == per_prompt
    batch = TrainBatch.from_samples(back, tokenizer.pad_token_id)
    assert multimodal_nbytes([batch.multimodal_inputs]) == per_prompt
    # and so does shipping the batch (or a micro-batch of it) to an actor
    assert ray.get(_storage_bytes.remote(batch)) == (per_prompt, 2)
    assert ray.get(_storage_bytes.remote(batch.select(list(range(n))))) == (
        multimodal_nbytes([prompts[0].multimodal_inputs]),
        1,
    )
    assert torch.equal(
        batch.multimodal_inputs[0]["input_features"], prompts[0].multimodal_inputs["input_features"]
    )
