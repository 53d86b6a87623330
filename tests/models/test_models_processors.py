"""Preprocessing on real files: image sizing within pixel budgets, PyAV frame sampling, 44.1 kHz -> 16 kHz
resampling, Whisper features and token expansion, and shared storage of a prompt's tensors."""

from __future__ import annotations

import math
import pickle
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
from models_media import random_image, write_video, write_wav
from PIL import Image

from relax_core.config.schema import ModalityConfig
from relax_core.errors import RelaxUserError
from relax_core.samples import PromptRecord, Sample
from relax_models.processors import (
    audio_token_count,
    build_multimodal_inputs,
    fit_size,
    load_audio,
    load_processor,
    multimodal_nbytes,
    patchify_frames,
    resample,
    sample_video,
)

FACTOR = 32  # patch 16 x merge 2


@pytest.fixture(scope="module")
def vl(tiny_folders: dict[str, Path]):
    return load_processor(tiny_folders["qwen3_vl"])


@pytest.fixture(scope="module")
def omni(tiny_folders: dict[str, Path]):
    return load_processor(tiny_folders["qwen3_omni"])


# ---------------------------------------------------------------- images


@pytest.mark.parametrize(("height", "width"), [(64, 96), (500, 333), (20, 30), (1000, 40), (3000, 2000)])
@pytest.mark.parametrize(("min_pixels", "max_pixels"), [(4 * 1024, 16 * 1024), (1024, 256 * 1024)])
def test_fit_size_respects_pixel_bounds(height: int, width: int, min_pixels: int, max_pixels: int) -> None:
    h, w = fit_size(height, width, FACTOR, min_pixels, max_pixels)
    assert h % FACTOR == 0 and w % FACTOR == 0
    assert min_pixels <= h * w <= max_pixels
    # shape kept within one block of rounding
    assert abs(h / w - height / width) <= (height / width) * (FACTOR / min(h, w)) + 1e-9


def test_fit_size_rejects_degenerate_images() -> None:
    with pytest.raises(RelaxUserError, match="too elongated"):
        fit_size(10, 3000, FACTOR, 1024, 65536)


def test_image_tokens_follow_min_max_pixels(vl) -> None:
    image = Image.fromarray(random_image(300, 450))
    counts = []
    for max_pixels in (8 * 1024, 32 * 1024, 128 * 1024):
        cfg = ModalityConfig(min_pixels=1024, max_pixels=max_pixels)
        ids, mm = build_multimodal_inputs(vl, "a<image>b", images=[image], modality_cfg=cfg)
        grid = mm["image_grid_thw"][0].tolist()
        tokens = grid[1] * grid[2] // 4
        assert ids.count(vl.token_id("image_token")) == tokens
        assert mm["pixel_values"].shape == (grid[1] * grid[2], 3 * 2 * 16 * 16)
        assert tokens * FACTOR * FACTOR <= max_pixels
        counts.append(tokens)
    assert counts[0] < counts[1] < counts[2]
    # a small image is scaled up to min_pixels
    _, mm = build_multimodal_inputs(
        vl, "<image>", images=[random_image(20, 20)], modality_cfg=ModalityConfig(min_pixels=16 * 1024)
    )
    assert mm["image_grid_thw"][0].prod() // 4 >= 16


def test_image_placeholders_and_inputs(vl, tmp_path: Path) -> None:
    path = tmp_path / "x.png"
    Image.fromarray(random_image(64, 64)).save(path)
    framed = "<|vision_start|><|image_pad|><|vision_end|>"
    by_path = build_multimodal_inputs(vl, f"q{framed}", images=[str(path)])
    by_bytes = build_multimodal_inputs(vl, "q<image>", images=[{"bytes": path.read_bytes()}])
    assert by_path[0] == by_bytes[0]
    assert torch.equal(by_path[1]["pixel_values"], by_bytes[1]["pixel_values"])
    assert by_path[0][0] == vl.tokenizer.convert_tokens_to_ids("q")
    assert by_path[0][1] == vl.token_id("vision_bos_token") and by_path[0][-1] == vl.token_id(
        "vision_eos_token"
    )
    assert build_multimodal_inputs(vl, "plain text")[1] is None
    with pytest.raises(RelaxUserError, match="1 image placeholder\\(s\\) but 2 image\\(s\\)"):
        build_multimodal_inputs(vl, "<image>", images=[str(path), str(path)])
    with pytest.raises(RelaxUserError, match="cannot take audio inputs"):
        build_multimodal_inputs(vl, "<audio>", audios=[str(path)])
    with pytest.raises(RelaxUserError, match="does not exist"):
        build_multimodal_inputs(vl, "<image>", images=[str(tmp_path / "missing.png")])


# ---------------------------------------------------------------- video


@pytest.mark.parametrize(
    ("fps", "min_frames", "max_frames", "expected"),
    [(2.0, 4, 32, 8), (1.0, 6, 32, 6), (2.0, 4, 4, 4), (1.0, 5, 32, 6), (20.0, 4, 64, 40), (0.25, 4, 32, 4)],
)
def test_video_sampling_honours_fps_and_frame_bounds(
    tmp_path: Path, fps: float, min_frames: int, max_frames: int, expected: int
) -> None:
    path = write_video(tmp_path / "v.mp4", n_frames=40, fps=10)  # 4 s
    clip = sample_video(path, fps=fps, min_frames=min_frames, max_frames=max_frames)
    assert clip.frames.shape == (expected, 64, 96, 3)
    assert clip.native_fps == pytest.approx(10) and clip.duration == pytest.approx(4)
    assert clip.indices == np.linspace(0, 39, expected).round().astype(int).tolist()
    # each decoded frame is the one its index names (frame i is gray level 6*i)
    levels = clip.frames.reshape(expected, -1).mean(1) / 6
    np.testing.assert_allclose(levels, clip.indices, atol=1.0)


def test_video_patches_match_image_layout(vl) -> None:
    """Two identical frames patchify exactly like the image processor patchifies one image."""
    frame = random_image(64, 96)
    image_out = vl.image_processor(images=[Image.fromarray(frame)], do_resize=False, return_tensors="np")
    x = frame.astype(np.float32).transpose(2, 0, 1)[None] / 255.0
    x = (x - 0.5) / 0.5
    patches, grid = patchify_frames(np.concatenate([x, x]), 16, 2, 2)
    assert list(grid) == image_out["image_grid_thw"][0].tolist()
    np.testing.assert_allclose(patches, image_out["pixel_values"], atol=1e-5)


def test_video_inputs_and_token_budget(vl, omni, tmp_path: Path) -> None:
    path = write_video(tmp_path / "v.mp4", n_frames=40, fps=10, height=128, width=192)
    cfg = ModalityConfig(video_fps=2.0, min_frames=4, max_frames=32, min_pixels=1024, max_pixels=64 * 1024)
    ids, mm = build_multimodal_inputs(vl, "watch <video> now", videos=[path], modality_cfg=cfg)
    t, h, w = mm["video_grid_thw"][0].tolist()
    assert t == 4  # 8 frames / temporal patch 2
    assert mm["pixel_values_videos"].shape == (t * h * w, 1536)
    assert ids.count(vl.token_id("video_token")) == t * h * w // 4
    text = vl.tokenizer.decode(ids)
    assert "<0.3 seconds>" in text and "<3.6 seconds>" in text  # Qwen3-VL timestamps per frame pair
    assert ids.count(vl.token_id("vision_bos_token")) == t
    # a budget of 16 tokens shrinks the frames; at least one token per frame pair
    small = replace(cfg, max_pixels=64 * 1024)
    small.video_max_tokens = 16  # an attribute the lead may add to ModalityConfig
    _, mm_small = build_multimodal_inputs(vl, "<video>", videos=[path], modality_cfg=small)
    t2, h2, w2 = mm_small["video_grid_thw"][0].tolist()
    assert t2 == 4 and t2 * h2 * w2 // 4 <= 16
    # Omni: one framed span per video, and the seconds each temporal patch covers
    ids, mm = build_multimodal_inputs(omni, "<video>", videos=[path.read_bytes()], modality_cfg=cfg)
    assert ids.count(omni.token_id("vision_bos_token")) == 1
    assert mm["video_second_per_grid"].tolist() == [pytest.approx(1.0)]


# ---------------------------------------------------------------- audio


def test_resample_44k1_to_16k_is_accurate_and_antialiased(tmp_path: Path) -> None:
    path = write_wav(tmp_path / "tone.wav", seconds=1.0, rate=44100, freq=1000.0, channels=2)
    wave, rate = load_audio(path)
    assert rate == 44100 and wave.shape == (44100,) and wave.dtype == np.float32
    out = resample(wave, 44100, 16000)
    assert out.shape == (16000,)
    t = np.arange(16000) / 16000
    inner = slice(400, -400)  # away from the zero-padded edges
    np.testing.assert_allclose(out[inner], 0.5 * np.sin(2 * np.pi * 1000 * t)[inner], atol=2e-3)
    # a 12 kHz tone is above the new 8 kHz Nyquist rate: it must be filtered, not folded to 4 kHz
    high = 0.5 * np.sin(2 * np.pi * 12000 * np.arange(44100) / 44100)
    assert np.sqrt(np.mean(resample(high, 44100, 16000)[inner] ** 2)) < 0.5 / math.sqrt(2) * 0.01
    # up-sampling 16 kHz -> 44.1 kHz reproduces the tone too
    up = resample(out, 16000, 44100)
    assert up.shape == (44100,)
    t_up = np.arange(44100) / 44100
    np.testing.assert_allclose(up[1200:-1200], 0.5 * np.sin(2 * np.pi * 1000 * t_up)[1200:-1200], atol=4e-3)
    # integer ratios and identity
    assert resample(np.ones(4800, np.float32), 48000, 16000).shape == (1600,)
    assert np.array_equal(resample(out, 16000, 16000), out)


def test_audio_features_and_tokens(omni, tmp_path: Path) -> None:
    path = write_wav(tmp_path / "a.wav", seconds=2.5, rate=44100)
    ids, mm = build_multimodal_inputs(
        omni, "hear <audio> and <image>", audios=[path], images=[random_image(64, 64)]
    )
    frames = 2.5 * 16000 / 160
    assert mm["input_features"].shape == (1, 128, frames)
    assert mm["feature_attention_mask"].sum() == frames
    assert ids.count(omni.token_id("audio_token")) == audio_token_count(int(frames)) == 2 * 13 + 7
    assert set(mm) == {"input_features", "feature_attention_mask", "pixel_values", "image_grid_thw"}
    # two clips of different lengths: one padded feature tensor, per-clip masks and token counts
    short = (np.zeros(8000, np.float32), 16000)
    ids, mm = build_multimodal_inputs(omni, "<audio><audio>", audios=[path, short])
    assert mm["feature_attention_mask"].sum(-1).tolist() == [frames, 50]
    assert ids.count(omni.token_id("audio_token")) == audio_token_count(int(frames)) + audio_token_count(50)
    with pytest.raises(RelaxUserError, match="audio_sample_rate=16000"):
        build_multimodal_inputs(
            omni, "<audio>", audios=[path], modality_cfg=ModalityConfig(audio_sample_rate=44100)
        )
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"not audio")
    with pytest.raises(RelaxUserError, match="cannot decode audio"):
        load_audio(bad)
    soundfile.write(str(tmp_path / "mono.wav"), np.zeros(100, np.float32), 8000)
    assert load_audio(tmp_path / "mono.wav")[0].shape == (100,)


# ---------------------------------------------------------------- sharing


def test_samples_of_a_prompt_share_one_set_of_tensors(omni, tmp_path: Path) -> None:
    ids, mm = build_multimodal_inputs(
        omni,
        "<image><audio>",
        images=[random_image(64, 64)],
        audios=[write_wav(tmp_path / "a.wav", 1.0, 16000)],
    )
    record = PromptRecord(index=0, prompt_ids=ids, prompt_text="", multimodal_inputs=mm)
    samples = [
        Sample(0, i, record.prompt_ids, [5], [0.0], [1], multimodal_inputs=record.multimodal_inputs)
        for i in range(8)
    ]
    one = multimodal_nbytes([mm])
    assert one == sum(t.numel() * t.element_size() for t in mm.values())
    assert multimodal_nbytes(samples) == one
    # pickling (as Ray does for one object) keeps the sharing; per-sample copies would not
    shared = len(pickle.dumps(samples))
    copied = len(
        pickle.dumps([replace(s, multimodal_inputs={k: v.clone() for k, v in mm.items()}) for s in samples])
    )
    assert shared < one * 1.5 < 4 * one < copied


def test_loads_a_v4_style_folder(tiny_folders: dict[str, Path], omni, tmp_path: Path) -> None:
    """Released Qwen3-Omni folders keep image-processor and feature-extractor settings in one
    ``preprocessor_config.json`` (no ``processor_config.json``); they load to the same preprocessing."""
    import json
    import shutil

    src = tiny_folders["qwen3_omni"]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp_path / name)
    nested = json.loads((src / "processor_config.json").read_text())
    merged = {
        **nested["feature_extractor"],
        **nested["image_processor"],
        "processor_class": "Qwen3OmniMoeProcessor",
    }
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(merged))
    loaded = load_processor(tmp_path)
    media = {
        "images": [random_image(64, 96)],
        "audios": [(np.sin(np.arange(24000) / 7).astype(np.float32), 16000)],
    }
    ids_a, mm_a = build_multimodal_inputs(loaded, "<image><audio>", **media)
    ids_b, mm_b = build_multimodal_inputs(omni, "<image><audio>", **media)
    assert ids_a == ids_b
    for key in mm_b:
        assert torch.equal(mm_a[key], mm_b[key]), key
