"""Bytes per sample of multimodal inputs when the n samples of a prompt share one set of tensors.

Builds the tiny Qwen3-Omni twin's processor (real Qwen3 settings: 16-px patches, 2x2 merge, 2-frame temporal
patches, 128-bin Whisper features), preprocesses an image, a larger image, a video and an audio clip, puts the
tensors in a ``PromptRecord`` and makes ``n`` ``Sample``s that reference them. Prints one JSON line per input:
storage counted once (shared) vs per-sample copies, the pickled size (what Ray ships for one object), and the
transient size of the concatenated forward kwargs for the whole group.

    python benchmarks/multimodal_bytes.py [--n 8]
"""

from __future__ import annotations

import argparse
import json
import pickle
import tempfile
import time
from pathlib import Path

import av
import numpy as np
import soundfile
import torch

from relax_core.config.schema import ModalityConfig
from relax_core.samples import PromptRecord, Sample, TrainBatch
from relax_models.families import forward_kwargs
from relax_models.processors import build_multimodal_inputs, load_processor, multimodal_nbytes
from relax_models.tiny_multimodal import build_tiny_qwen3_omni


def smooth_image(height: int, width: int, seed: int) -> np.ndarray:
    """A photo-like RGB image: smooth gradients plus mild noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    base = np.stack([np.sin(6 * x + c) * np.cos(4 * y - c) for c in range(3)], axis=-1)
    return np.clip(127 + 100 * base + rng.normal(0, 8, base.shape), 0, 255).astype(np.uint8)


def write_video(path: Path, seconds: int, fps: int, height: int, width: int) -> Path:
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(seconds * fps):
            frame = np.roll(smooth_image(height, width, 0), 4 * i, axis=1)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def measure(name: str, processor, text: str, n: int, **media) -> dict:
    cfg = ModalityConfig()
    start = time.perf_counter()
    ids, mm = build_multimodal_inputs(processor, text, modality_cfg=cfg, **media)
    seconds = time.perf_counter() - start
    record = PromptRecord(index=0, prompt_ids=ids, prompt_text=text, multimodal_inputs=mm)
    samples = [
        Sample(
            0,
            i,
            record.prompt_ids,
            [1] * 16,
            [0.0] * 16,
            [1] * 16,
            multimodal_inputs=record.multimodal_inputs,
        )
        for i in range(n)
    ]
    copies = [
        Sample(
            0, i, ids, [1] * 16, [0.0] * 16, [1] * 16, multimodal_inputs={k: v.clone() for k, v in mm.items()}
        )
        for i in range(n)
    ]
    one = multimodal_nbytes([mm])
    batch = TrainBatch.from_samples(samples, pad_token_id=0)
    kwargs = forward_kwargs("qwen3_omni", batch.multimodal_inputs, input_ids=batch.input_ids)
    pixels = mm.get("pixel_values", mm.get("pixel_values_videos"))
    return {
        "input": name,
        "n_samples": n,
        "prompt_tokens": len(ids),
        "tensor_shapes": {k: list(v.shape) for k, v in mm.items()},
        "preprocess_ms": round(seconds * 1000, 1),
        "bytes_per_prompt": one,
        "bytes_per_sample_shared": one // n,
        "bytes_per_sample_copied": multimodal_nbytes(copies) // n,
        "pickled_bytes_per_sample_shared": len(pickle.dumps(samples)) // n,
        "pickled_bytes_per_sample_copied": len(pickle.dumps(copies)) // n,
        "train_batch_bytes": multimodal_nbytes([batch.multimodal_inputs]),
        "forward_kwargs_bytes_for_group": sum(v.numel() * v.element_size() for v in kwargs.values()),
        "pixel_bytes_if_bf16": None if pixels is None else pixels.numel() * 2,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        processor = load_processor(build_tiny_qwen3_omni(root / "omni", seed=0))
        wav = root / "speech.wav"
        t = np.arange(10 * 44100) / 44100
        soundfile.write(str(wav), (0.3 * np.sin(2 * np.pi * 220 * t) * np.sin(2 * np.pi * 0.5 * t)), 44100)
        video = write_video(root / "clip.mp4", seconds=4, fps=10, height=240, width=320)
        cases = [
            ("image_448x448", "Describe <image>.", {"images": [smooth_image(448, 448, 1)]}),
            ("image_1024x768", "Describe <image>.", {"images": [smooth_image(768, 1024, 2)]}),
            ("video_4s_320x240", "What happens in <video>?", {"videos": [video]}),
            ("audio_10s_44k1", "Transcribe <audio>.", {"audios": [wav]}),
        ]
        for name, text, media in cases:
            print(json.dumps(measure(name, processor, text, args.n, **media)), flush=True)


if __name__ == "__main__":
    main()
