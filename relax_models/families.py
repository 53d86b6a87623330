"""Registry of model families: what each accepts, which transformers classes implement it, its tiny twin.

A *family* is the user-facing ``model.family`` name. Each maps to one or more HF ``model_type`` values (what a
checkpoint folder's ``config.json`` says), the class we train and roll out, the input kinds it takes
(``text``, ``image``, ``video``, ``audio``) and the multimodal keyword arguments its ``forward`` accepts.

``forward_kwargs`` turns the multimodal tensors stored with samples (see ``relax_models.processors``) into
those keyword arguments for a batch, so a backend can call
``model(input_ids=..., attention_mask=..., **forward_kwargs(family, batch.multimodal_inputs, ...))``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from relax_models.cache import build_once, cache_root
from relax_models.errors import RelaxUserError

# what every tiny builder writes last: the recipe the folder was built from
TINY_MARKER = "relax_tiny.json"
# input kinds each user-facing modality (``conf/modality/``) needs; ``image``/``video`` are finer choices
MODALITY_INPUTS: dict[str, tuple[str, ...]] = {
    "text": ("text",),
    "vision": ("text", "image", "video"),
    "image": ("text", "image"),
    "video": ("text", "video"),
    "audio": ("text", "audio"),
    "omni": ("text", "image", "video", "audio"),
}

# multimodal keys that are per prompt item (concatenated along dim 0 across a batch)
_CONCAT_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "video_second_per_grid",
)
# audio keys: [n_audios, mel, frames] / [n_audios, frames]; frames are padded to the batch's longest
_AUDIO_KEYS = ("input_features", "feature_attention_mask")


@dataclass(frozen=True)
class FamilySpec:
    """One model family."""

    name: str
    # HF ``model_type`` values of checkpoint folders of this family (first: what our tiny twin writes)
    model_types: tuple[str, ...]
    # transformers class names (resolved lazily so importing this module stays cheap)
    config_class: str
    model_class: str
    inputs: frozenset[str]
    # multimodal kwargs of ``model_class.forward`` that ``forward_kwargs`` may return
    forward_keys: tuple[str, ...] = ()
    # Qwen3-VL writes "<t seconds>" before each video frame group; the Omni thinker does not
    video_timestamps: bool = False
    # HF processor classes a torchvision-enabled ``AutoProcessor`` builds for this family's folders
    processor_class: str = ""
    video_processor_class: str = ""
    # real checkpoints of this family (documentation and configs)
    examples: tuple[str, ...] = ()
    # dotted path of ``fn(folder, seed, **dims) -> Path`` building a random-init twin
    tiny_builder: str = ""

    @property
    def modalities(self) -> list[str]:
        """User-facing modality names this family can take."""
        return [m for m, need in MODALITY_INPUTS.items() if set(need) <= self.inputs]

    def resolve(self, class_name: str) -> type:
        import transformers

        return getattr(transformers, class_name)

    @property
    def model_cls(self) -> type:
        return self.resolve(self.model_class)

    @property
    def config_cls(self) -> type:
        return self.resolve(self.config_class)

    def build_tiny(self, folder: str | Path, seed: int, **dims: Any) -> Path:
        """Write this family's random-init tiny twin (model + tokenizer/processor) to ``folder``.

        The build is deterministic, so it is made once per recipe in the user cache
        (:func:`relax_models.cache.cache_root`) and copied from there: a launch then does not import the family's modeling
        code, ~3 s of a tiny run's start on 2 cores. Without a writable cache it is built in place."""
        folder = Path(folder)
        try:
            cached = self._cached_tiny(seed, dims)
        except OSError:
            return self._build_tiny(folder, seed, dims)
        marker = folder / TINY_MARKER
        if not (marker.is_file() and marker.read_bytes() == (cached / TINY_MARKER).read_bytes()):
            shutil.copytree(cached, folder, dirs_exist_ok=True)
        return folder

    def _build_tiny(self, folder: Path, seed: int, dims: dict[str, Any]) -> Path:
        module_name, fn_name = self.tiny_builder.rsplit(".", 1)
        fn: Callable[..., Path] = getattr(importlib.import_module(module_name), fn_name)
        return fn(folder, seed=seed, **dims)

    def _cached_tiny(self, seed: int, dims: dict[str, Any]) -> Path:
        """The cache folder of this recipe, built first if missing; keyed by everything the build reads."""
        key = {
            "builder": self.tiny_builder,
            "seed": seed,
            "dims": dims,
            "versions": [importlib.metadata.version(p) for p in ("torch", "transformers", "tokenizers")],
            "sources": hashlib.sha256(
                b"".join(p.read_bytes() for p in sorted(Path(__file__).parent.rglob("*.py")))
            ).hexdigest(),
        }
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
        cached = cache_root() / "tiny_models" / f"{self.name}-{digest}"
        return build_once(
            cached,
            lambda f: (f / TINY_MARKER).is_file(),
            lambda scratch: self._build_tiny(scratch, seed, dims),
        )

    def load(
        self, path: str | Path, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"
    ) -> torch.nn.Module:
        """The trainable model from a local folder.

        A full Qwen3-Omni checkpoint (``model_type: qwen3_omni_moe``, thinker + talker + code2wav) is loaded
        without the talker and its thinker returned: that is the part that reads text/image/audio and writes
        text. Its parameter names then lack the checkpoint's ``thinker.`` prefix.
        """
        model_type = self._folder_config(path).model_type
        kwargs = {"dtype": dtype, "attn_implementation": attn_implementation}
        if model_type == "qwen3_omni_moe":
            full = self.resolve("Qwen3OmniMoeForConditionalGeneration").from_pretrained(
                path, enable_audio_output=False, **kwargs
            )
            return full.thinker
        return self.model_cls.from_pretrained(path, **kwargs)

    def empty(
        self, path: str | Path, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"
    ) -> torch.nn.Module:
        """The module :meth:`load` returns, built on the meta device from the folder's config: parameter
        names and shapes without reading or allocating any weight (FSDP ranks receive their shards)."""
        config = self._folder_config(path)
        if config.model_type == "qwen3_omni_moe":  # what ``load`` keeps of a full Omni checkpoint
            config = config.thinker_config
        with torch.device("meta"):
            return self.model_cls._from_config(config, dtype=dtype, attn_implementation=attn_implementation)

    def _folder_config(self, path: str | Path) -> Any:
        """The folder's HF config, checked to belong to this family."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
        if config.model_type not in self.model_types:
            raise RelaxUserError(
                f"{path} holds a {config.model_type!r} checkpoint, not model family {self.name!r} "
                f"(expects model_type {' or '.join(self.model_types)})"
            )
        return config


_VL_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "mm_token_type_ids")

FAMILIES: dict[str, FamilySpec] = {
    spec.name: spec
    for spec in (
        FamilySpec(
            name="qwen3",
            model_types=("qwen3",),
            config_class="Qwen3Config",
            model_class="Qwen3ForCausalLM",
            inputs=frozenset({"text"}),
            examples=("Qwen/Qwen3-4B",),
            tiny_builder="relax_models.tiny.build_tiny_qwen3",
        ),
        FamilySpec(
            name="qwen3_moe",
            model_types=("qwen3_moe",),
            config_class="Qwen3MoeConfig",
            model_class="Qwen3MoeForCausalLM",
            inputs=frozenset({"text"}),
            examples=("Qwen/Qwen3-30B-A3B",),
            tiny_builder="relax_models.tiny_multimodal.build_tiny_qwen3_moe",
        ),
        FamilySpec(
            name="qwen3_vl",
            model_types=("qwen3_vl",),
            config_class="Qwen3VLConfig",
            model_class="Qwen3VLForConditionalGeneration",
            inputs=frozenset({"text", "image", "video"}),
            forward_keys=_VL_KEYS,
            video_timestamps=True,
            processor_class="Qwen3VLProcessor",
            video_processor_class="Qwen3VLVideoProcessor",
            examples=("Qwen/Qwen3-VL-4B-Instruct",),
            tiny_builder="relax_models.tiny_multimodal.build_tiny_qwen3_vl",
        ),
        FamilySpec(
            name="qwen3_vl_moe",
            model_types=("qwen3_vl_moe",),
            config_class="Qwen3VLMoeConfig",
            model_class="Qwen3VLMoeForConditionalGeneration",
            inputs=frozenset({"text", "image", "video"}),
            forward_keys=_VL_KEYS,
            video_timestamps=True,
            processor_class="Qwen3VLProcessor",
            video_processor_class="Qwen3VLVideoProcessor",
            examples=("Qwen/Qwen3-VL-30B-A3B-Instruct",),
            tiny_builder="relax_models.tiny_multimodal.build_tiny_qwen3_vl_moe",
        ),
        FamilySpec(
            name="qwen3_omni",
            # full checkpoint (thinker + talker) or a thinker-only export
            model_types=("qwen3_omni_moe", "qwen3_omni_moe_thinker"),
            config_class="Qwen3OmniMoeThinkerConfig",
            model_class="Qwen3OmniMoeThinkerForConditionalGeneration",
            inputs=frozenset({"text", "image", "video", "audio"}),
            forward_keys=(
                "pixel_values",
                "image_grid_thw",
                "pixel_values_videos",
                "video_grid_thw",
                "video_second_per_grid",
                "input_features",
                "feature_attention_mask",
            ),
            processor_class="Qwen3OmniMoeProcessor",
            video_processor_class="Qwen2VLVideoProcessor",
            examples=("Qwen/Qwen3-Omni-30B-A3B-Instruct",),
            tiny_builder="relax_models.tiny_multimodal.build_tiny_qwen3_omni",
        ),
    )
}


def get_family(family: str) -> FamilySpec:
    """The spec of ``family``; a clear error names the known ones."""
    try:
        return FAMILIES[family]
    except KeyError:
        raise RelaxUserError(f"unknown model family {family!r}; choose one of {sorted(FAMILIES)}") from None


def family_for_model_type(model_type: str) -> str:
    """The family of a checkpoint folder's HF ``model_type`` (e.g. ``qwen3_vl_moe`` -> ``qwen3_vl_moe``)."""
    for spec in FAMILIES.values():
        if model_type in spec.model_types:
            return spec.name
    known = sorted(t for s in FAMILIES.values() for t in s.model_types)
    raise RelaxUserError(f"no model family takes model_type {model_type!r}; supported model_types: {known}")


def check_modality(family: str, modality: str) -> None:
    """Raise ``RelaxUserError`` unless ``family`` can take every input ``modality`` needs."""
    spec = get_family(family)
    if modality not in MODALITY_INPUTS:
        raise RelaxUserError(f"unknown modality {modality!r}; choose one of {sorted(MODALITY_INPUTS)}")
    if not set(MODALITY_INPUTS[modality]) <= spec.inputs:
        raise RelaxUserError(
            f"model family {spec.name} cannot take modality {modality!r}; choose one of {spec.modalities}"
        )


def _pad_frames(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along dim 0 after right-padding the last dim (audio frames) with zeros."""
    longest = max(t.shape[-1] for t in tensors)
    padded = [torch.nn.functional.pad(t, (0, longest - t.shape[-1])) for t in tensors]
    return torch.cat(padded, dim=0)


def forward_kwargs(
    family: str,
    multimodal_inputs: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor] | None] | None,
    *,
    input_ids: torch.Tensor | None = None,
    config: Any = None,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """Keyword arguments for ``model.forward`` from the multimodal tensors of one sample or a batch.

    ``multimodal_inputs`` is one sample's dict or the per-row list of a batch (``TrainBatch.multimodal_inputs``,
    ``None`` for text-only rows), in the same row order as ``input_ids``. For a batch:

    - ``pixel_values`` / ``pixel_values_videos`` (patches x patch_dim) and ``image_grid_thw`` /
      ``video_grid_thw`` (one row per item) are concatenated along dim 0 in row order; the model splits them
      by the grids and fills the placeholder tokens of ``input_ids`` in reading order, row by row.
      Samples of one prompt point at the same tensors, so those appear once per row that uses them.
    - ``input_features`` ``[n_audio, mel, frames]`` and ``feature_attention_mask`` ``[n_audio, frames]`` are
      right-padded to the longest clip (mask 0) and concatenated along dim 0.
    - Qwen3-VL also needs ``mm_token_type_ids`` (0 text, 1 image, 2 video per position of ``input_ids``),
      derived here from ``input_ids`` and the model ``config``'s image/video token ids; any padding side works.
    """
    spec = get_family(family)
    rows = (
        [multimodal_inputs]
        if multimodal_inputs is None or isinstance(multimodal_inputs, Mapping)
        else list(multimodal_inputs)
    )
    present = [r for r in rows if r]
    if not spec.forward_keys:
        if present:
            raise RelaxUserError(
                f"model family {spec.name} takes text only, but samples carry multimodal inputs"
            )
        return {}
    unknown = {k for r in present for k in r} - set(spec.forward_keys)
    if unknown:
        raise ValueError(f"model family {spec.name} does not take multimodal inputs {sorted(unknown)}")
    out: dict[str, torch.Tensor] = {}
    for key in _CONCAT_KEYS + _AUDIO_KEYS:
        parts = [r[key] for r in present if key in r]
        if parts:
            out[key] = _pad_frames(parts) if key in _AUDIO_KEYS else torch.cat(parts, dim=0)
    has_vision = "image_grid_thw" in out or "video_grid_thw" in out
    if "mm_token_type_ids" in spec.forward_keys and has_vision:
        if input_ids is None or config is None:
            raise ValueError(
                f"{spec.name} needs input_ids and the model config to mark image/video positions"
            )
        types = torch.zeros_like(input_ids, dtype=torch.int32)
        types[input_ids == config.image_token_id] = 1
        types[input_ids == config.video_token_id] = 2
        out["mm_token_type_ids"] = types
    if device is not None:
        out = {k: v.to(device) for k, v in out.items()}
    return out


def rope_positions(
    family: str,
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    mm_kwargs: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids for a prefill of ``input_ids`` (any padding side) and per-row decode offsets.

    Returns ``(position_ids, deltas)``: ``position_ids`` is ``[B, L]`` for text families and ``[3, B, L]``
    (time, height, width M-RoPE) for Qwen3-VL / Qwen3-Omni, where media tokens take grid positions and the
    following text continues after the largest of them. ``deltas`` ``[B, 1]``: a later token whose index
    among the row's real tokens is ``v`` sits at position ``v + delta`` in all three dims (see
    :func:`decode_positions`). ``mm_kwargs`` is what :func:`forward_kwargs` returned for these rows.
    Passing 1-D positions to a multimodal model instead would give image tokens plain text positions.
    """
    spec = get_family(family)
    mm = dict(mm_kwargs or {})
    if not spec.forward_keys:
        positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        return positions, torch.zeros((input_ids.shape[0], 1), dtype=torch.long, device=input_ids.device)
    inner = model.model
    if "mm_token_type_ids" in spec.forward_keys:
        types = mm.get("mm_token_type_ids")
        if types is None:
            types = torch.zeros_like(input_ids, dtype=torch.int32)
        return inner.get_rope_index(
            input_ids,
            types,
            image_grid_thw=mm.get("image_grid_thw"),
            video_grid_thw=mm.get("video_grid_thw"),
            attention_mask=attention_mask,
        )
    features = mm.get("feature_attention_mask")
    return inner.get_rope_index(
        input_ids,
        mm.get("image_grid_thw"),
        mm.get("video_grid_thw"),
        attention_mask,
        False,
        None if features is None else features.sum(-1),
        mm.get("video_second_per_grid"),
    )


def decode_positions(family: str, next_index: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """``position_ids`` for one decoded token per row: ``next_index`` ``[B]`` counts the row's real tokens
    before it, ``deltas`` come from :func:`rope_positions`. ``[B, 1]`` for text, ``[3, B, 1]`` for M-RoPE."""
    positions = next_index.view(-1, 1) + deltas.to(next_index.device)
    if not get_family(family).forward_keys:
        return positions
    return positions.unsqueeze(0).expand(3, -1, -1)
