"""Turn a prompt with images, videos and audio clips into token ids plus the tensors a model forward needs.

:class:`MultimodalProcessor` bundles what a model folder provides for that (tokenizer, image processor,
audio feature extractor) and works without torchvision, which transformers' own video processors need.
:func:`build_multimodal_inputs` is the one entry point for the data loader and the rollout engine.

Sharing: the dict returned for a prompt is meant to live in ``PromptRecord.multimodal_inputs`` and to be
*referenced* (not copied) by each of the prompt's n samples; :func:`multimodal_nbytes` counts shared
storage once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from relax_models.config import MediaSettings
from relax_models.errors import RelaxUserError
from relax_models.families import FamilySpec, family_for_model_type, get_family
from relax_models.processors.audio import audio_token_count, load_audio, resample
from relax_models.processors.image import load_image, resize_image
from relax_models.processors.video import patchify_frames, sample_video, video_frame_size

# LLM tokens one video may cost when the settings name no ``video_max_tokens``
DEFAULT_VIDEO_MAX_TOKENS = 2048

# special-token roles -> the strings Qwen3-VL / Qwen3-Omni tokenizers use (overridden by tokenizer attributes)
DEFAULT_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "audio_token": "<|audio_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}
# dataset-style markers a prompt may use instead of the model's own placeholders
GENERIC_MARKERS = {"image": "<image>", "video": "<video>", "audio": "<audio>"}


@dataclass
class MultimodalProcessor:
    """Tokenizer + per-modality preprocessors of one model folder."""

    tokenizer: Any
    family: str
    image_processor: Any = None  # a transformers Qwen2-VL image processor (PIL or torchvision backend)
    feature_extractor: Any = None  # a transformers WhisperFeatureExtractor
    audio_n_window: int = 50

    @property
    def spec(self) -> FamilySpec:
        return get_family(self.family)

    @property
    def patch_size(self) -> int:
        return int(self.image_processor.patch_size)

    @property
    def merge_size(self) -> int:
        return int(self.image_processor.merge_size)

    @property
    def temporal_patch_size(self) -> int:
        return int(self.image_processor.temporal_patch_size)

    @property
    def factor(self) -> int:
        """Pixels per side of the block that becomes one LLM token."""
        return self.patch_size * self.merge_size

    def token(self, role: str) -> str:
        """The special-token string for ``role`` (e.g. ``image_token``)."""
        return getattr(self.tokenizer, role, None) or DEFAULT_TOKENS[role]

    def token_id(self, role: str) -> int:
        tok = self.token(role)
        ids = self.tokenizer.convert_tokens_to_ids([tok])
        if not ids or ids[0] is None or ids[0] == self.tokenizer.unk_token_id:
            raise RelaxUserError(f"the tokenizer has no {tok!r} token; is this a {self.family} model folder?")
        return int(ids[0])

    def save_pretrained(self, folder: str | Path) -> None:
        """Write the tokenizer and a transformers-style ``processor_config.json`` (image processor, video
        processor and feature extractor settings) so that ``AutoProcessor`` loads the folder where
        torchvision is installed and :func:`load_processor` loads it everywhere."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save_pretrained(folder)
        spec = self.spec
        config: dict[str, Any] = {"processor_class": spec.processor_class}
        if self.image_processor is not None:
            image = self.image_processor.to_dict()
            image["image_processor_type"] = "Qwen2VLImageProcessor"
            config["image_processor"] = image
            config["video_processor"] = {
                "video_processor_type": spec.video_processor_class,
                **{k: image[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "size")},
                **{k: image[k] for k in ("image_mean", "image_std", "rescale_factor", "resample")},
                "do_resize": True,
                "do_rescale": True,
                "do_normalize": True,
                "do_convert_rgb": True,
                "do_sample_frames": True,
                "fps": 2.0,
                "min_frames": 4,
                "max_frames": 768,
            }
        if self.feature_extractor is not None:
            config["feature_extractor"] = self.feature_extractor.to_dict()
        (folder / "processor_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_processor(path: str | Path) -> MultimodalProcessor:
    """The processor of a model folder (ours or a real Qwen3 / Qwen3-VL / Qwen3-Omni checkpoint)."""
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoTokenizer

    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise RelaxUserError(f"{path} is not a model folder (no config.json there)")
    config = json.loads(config_file.read_text())
    spec = get_family(family_for_model_type(config.get("model_type", "")))
    tokenizer = AutoTokenizer.from_pretrained(path)
    image_processor = feature_extractor = None
    if {"image", "video"} & spec.inputs:
        image_processor = AutoImageProcessor.from_pretrained(path)
    n_window = 50
    if "audio" in spec.inputs:
        feature_extractor = AutoFeatureExtractor.from_pretrained(path)
        thinker = config.get("thinker_config", config)
        n_window = int(thinker.get("audio_config", {}).get("n_window", n_window))
    return MultimodalProcessor(tokenizer, spec.name, image_processor, feature_extractor, n_window)


def _placeholder_pattern(proc: MultimodalProcessor, kinds: Iterable[str]) -> re.Pattern[str]:
    """Regex matching any placeholder of ``kinds``: the framed model form (e.g.
    ``<|vision_start|><|image_pad|><|vision_end|>``), the bare pad token, or the generic marker."""
    alternatives: list[tuple[str, str]] = []
    for kind in kinds:
        pad = proc.token(f"{kind}_token")
        bos, eos = (
            ("vision_bos_token", "vision_eos_token")
            if kind != "audio"
            else ("audio_bos_token", "audio_eos_token")
        )
        framed = proc.token(bos) + pad + proc.token(eos)
        alternatives += [(kind, framed), (kind, pad), (kind, GENERIC_MARKERS[kind])]
    parts = [f"(?P<{kind}{i}>{re.escape(s)})" for i, (kind, s) in enumerate(alternatives)]
    return re.compile("|".join(parts))


def _split_prompt(proc: MultimodalProcessor, text: str, kinds: list[str]) -> list[tuple[str, str]]:
    """``text`` as ``[(kind, segment)]`` where kind is ``text`` or a media kind (one per placeholder)."""
    if not kinds:
        return [("text", text)]
    pieces: list[tuple[str, str]] = []
    pos = 0
    for match in _placeholder_pattern(proc, kinds).finditer(text):
        if match.start() > pos:
            pieces.append(("text", text[pos : match.start()]))
        kind = re.sub(r"\d+$", "", match.lastgroup or "")
        pieces.append((kind, match.group()))
        pos = match.end()
    if pos < len(text):
        pieces.append(("text", text[pos:]))
    return pieces


def _normalize(frames: np.ndarray, image_processor: Any) -> np.ndarray:
    """uint8 ``[T, H, W, C]`` -> float32 ``[T, C, H, W]`` rescaled and normalized like the image processor."""
    x = frames.astype(np.float32).transpose(0, 3, 1, 2) * float(image_processor.rescale_factor)
    mean = np.asarray(image_processor.image_mean, dtype=np.float32)[None, :, None, None]
    std = np.asarray(image_processor.image_std, dtype=np.float32)[None, :, None, None]
    return (x - mean) / std


def _process_videos(
    proc: MultimodalProcessor, videos: Sequence[Any], cfg: MediaSettings
) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """Tensors for ``videos`` and, per video, the LLM token ids that stand for it."""
    tp, factor = proc.temporal_patch_size, proc.factor
    budget = cfg.video_max_tokens or DEFAULT_VIDEO_MAX_TOKENS
    vs, ve, pad = (
        proc.token_id("vision_bos_token"),
        proc.token_id("vision_eos_token"),
        proc.token_id("video_token"),
    )
    patches, grids, seconds, spans = [], [], [], []
    for item in videos:
        # at least one token per temporal group: the budget bounds the frame count too
        clip = sample_video(item, cfg.video_fps, cfg.min_frames, min(cfg.max_frames, budget * tp), tp)
        n, height, width = clip.frames.shape[:3]
        h, w = video_frame_size(n, height, width, factor, tp, cfg.min_pixels, cfg.max_pixels, budget)
        if (h, w) != (height, width):
            resized = [Image.fromarray(f).resize((w, h), Image.Resampling.BICUBIC) for f in clip.frames]
            frames = np.stack([np.asarray(f) for f in resized])
        else:
            frames = clip.frames
        flat, (gt, gh, gw) = patchify_frames(
            _normalize(frames, proc.image_processor), proc.patch_size, proc.merge_size, tp
        )
        patches.append(torch.from_numpy(flat))
        grids.append([gt, gh, gw])
        seconds.append(tp / clip.sample_fps)
        per_group = gh * gw // proc.merge_size**2
        if proc.spec.video_timestamps:  # Qwen3-VL: "<t seconds>" + framed tokens for each temporal group
            ids: list[int] = []
            for t in clip.group_timestamps(tp):
                ids += proc.tokenizer(f"<{t:.1f} seconds>", add_special_tokens=False).input_ids
                ids += [vs] + [pad] * per_group + [ve]
        else:
            ids = [vs] + [pad] * (per_group * gt) + [ve]
        spans.append(ids)
    tensors = {
        "pixel_values_videos": torch.cat(patches),
        "video_grid_thw": torch.tensor(grids, dtype=torch.long),
    }
    if "video_second_per_grid" in proc.spec.forward_keys:
        tensors["video_second_per_grid"] = torch.tensor(seconds, dtype=torch.float32)
    return tensors, spans


def _process_audios(
    proc: MultimodalProcessor, audios: Sequence[Any], cfg: MediaSettings
) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    fe = proc.feature_extractor
    if cfg.audio_sample_rate != fe.sampling_rate:
        raise RelaxUserError(
            f"modality.audio_sample_rate={cfg.audio_sample_rate} but this model's audio features are computed "
            f"at {fe.sampling_rate} Hz; set modality.audio_sample_rate={fe.sampling_rate}"
        )
    waves = []
    for item in audios:
        wave, rate = load_audio(item)
        waves.append(resample(wave, rate, fe.sampling_rate) if rate != fe.sampling_rate else wave)
    feats = fe(
        waves,
        sampling_rate=fe.sampling_rate,
        padding="longest",
        truncation=False,
        return_attention_mask=True,
        return_tensors="pt",
    )
    mask = feats["attention_mask"].to(torch.long)
    bos, eos, pad = (
        proc.token_id("audio_bos_token"),
        proc.token_id("audio_eos_token"),
        proc.token_id("audio_token"),
    )
    spans = [[bos] + [pad] * audio_token_count(int(n), proc.audio_n_window) + [eos] for n in mask.sum(-1)]
    tensors = {"input_features": feats["input_features"].to(torch.float32), "feature_attention_mask": mask}
    return tensors, spans


def build_multimodal_inputs(
    processor: MultimodalProcessor,
    text: str,
    images: Sequence[Any] | None = None,
    videos: Sequence[Any] | None = None,
    audios: Sequence[Any] | None = None,
    modality_cfg: MediaSettings | None = None,
    pixel_dtype: torch.dtype = torch.float32,
) -> tuple[list[int], dict[str, torch.Tensor] | None]:
    """Token ids of ``text`` with each media placeholder expanded, and the tensors the model forward needs.

    ``text`` (already chat-formatted, if wanted) marks where each item goes, in order, with the model's own
    placeholder (``<|vision_start|><|image_pad|><|vision_end|>``, ``<|video_pad|>``, ``<|audio_pad|>``, framed
    or bare) or a generic ``<image>`` / ``<video>`` / ``<audio>``; the count per kind must match the items.
    Images are resized within ``min_pixels``..``max_pixels``; videos are sampled at ``video_fps`` within
    ``min_frames``..``max_frames`` and sized so that each costs at most ``video_max_tokens`` (else
    ``DEFAULT_VIDEO_MAX_TOKENS``); all from ``modality_cfg`` (:class:`MediaSettings`); audio is resampled to the
    feature extractor's rate (16 kHz).

    Returns ``(prompt_ids, tensors)``; ``tensors`` is ``None`` for a text-only prompt, else a dict with
    ``pixel_values`` + ``image_grid_thw``, ``pixel_values_videos`` + ``video_grid_thw`` (+
    ``video_second_per_grid`` for Qwen3-Omni), ``input_features`` + ``feature_attention_mask``.
    """
    cfg = modality_cfg or MediaSettings()
    spec = processor.spec
    items = {"image": list(images or []), "video": list(videos or []), "audio": list(audios or [])}
    kinds = [k for k in ("image", "video", "audio") if k in spec.inputs]
    for kind, given in items.items():
        if given and kind not in spec.inputs:
            raise RelaxUserError(
                f"model family {spec.name} cannot take {kind} inputs; it takes {sorted(spec.inputs)}"
            )
    pieces = _split_prompt(processor, text, kinds)
    for kind in kinds:
        found = sum(1 for k, _ in pieces if k == kind)
        if found != len(items[kind]):
            raise RelaxUserError(
                f"prompt has {found} {kind} placeholder(s) but {len(items[kind])} {kind}(s) were given; "
                f"mark each {kind}'s place in the prompt with {GENERIC_MARKERS[kind]!r}"
            )

    tensors: dict[str, torch.Tensor] = {}
    spans: dict[str, list[list[int]]] = {"image": [], "video": [], "audio": []}
    if items["image"]:
        pictures = [
            resize_image(load_image(x), processor.factor, cfg.min_pixels, cfg.max_pixels)
            for x in items["image"]
        ]
        out = processor.image_processor(images=pictures, do_resize=False, return_tensors="pt")
        tensors["pixel_values"] = out["pixel_values"].to(pixel_dtype)
        tensors["image_grid_thw"] = out["image_grid_thw"].to(torch.long)
        vs, ve = processor.token_id("vision_bos_token"), processor.token_id("vision_eos_token")
        pad = processor.token_id("image_token")
        per_image = (tensors["image_grid_thw"].prod(-1) // processor.merge_size**2).tolist()
        spans["image"] = [[vs] + [pad] * n + [ve] for n in per_image]
    if items["video"]:
        video_tensors, spans["video"] = _process_videos(processor, items["video"], cfg)
        video_tensors["pixel_values_videos"] = video_tensors["pixel_values_videos"].to(pixel_dtype)
        tensors.update(video_tensors)
    if items["audio"]:
        audio_tensors, spans["audio"] = _process_audios(processor, items["audio"], cfg)
        tensors.update(audio_tensors)

    ids: list[int] = []
    cursor = {"image": 0, "video": 0, "audio": 0}
    for kind, segment in pieces:
        if kind == "text":
            ids += processor.tokenizer(segment, add_special_tokens=False).input_ids
        else:
            ids += spans[kind][cursor[kind]]
            cursor[kind] += 1
    return ids, (tensors or None)


def multimodal_nbytes(objects: Iterable[Any]) -> int:
    """Bytes of tensor storage reachable from ``objects`` (samples, records or dicts), each storage once."""
    seen: set[int] = set()
    total = 0

    def visit(obj: Any) -> None:
        nonlocal total
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(obj, dict):
            for value in obj.values():
                visit(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                visit(value)
        elif hasattr(obj, "multimodal_inputs"):
            visit(obj.multimodal_inputs)

    for obj in objects:
        visit(obj)
    return total
