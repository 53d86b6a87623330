"""Multimodal prompts end to end: dataset columns -> media items -> processor tensors -> model forward kwargs.

``modality.keys`` maps an input kind (``image``, ``video``, ``audio``) to the dataset column holding that kind's
items. Loading a dataset keeps only the *references* (paths, bytes) of a row's media in
``PromptRecord.media`` together with the expanded prompt ids (each placeholder replaced by its media tokens),
so a dataset of many images costs no pixel memory. The tensors are built when a prompt is drawn
(:meth:`MediaPrompts.materialize`, in the Rollout role and for the warm-start) and then referenced, never
copied, by the prompt's n samples: ``Sample.multimodal_inputs`` is the record's dict, ``TrainBatch`` keeps the
per-row references, and one pickle (a Ray call) ships a shared dict once.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from relax_core.data.prompts import get_field
from relax_core.errors import RelaxUserError
from relax_core.samples import PromptRecord, TrainBatch

if TYPE_CHECKING:
    from relax_core.config.schema import ModalityConfig, RelaxConfig

MEDIA_KINDS = ("image", "video", "audio")
# build_multimodal_inputs keyword per kind
KIND_ARGUMENT = {"image": "images", "video": "videos", "audio": "audios"}


def check_modality_keys(modality_cfg: ModalityConfig) -> None:
    """``modality.keys`` names only kinds that ``modality.name`` takes (``text`` takes none)."""
    from relax_models.families import MODALITY_INPUTS

    if modality_cfg.name not in MODALITY_INPUTS:
        raise RelaxUserError(f"modality.name={modality_cfg.name!r} is not one of {sorted(MODALITY_INPUTS)}")
    allowed = [k for k in MODALITY_INPUTS[modality_cfg.name] if k != "text"]
    for kind, column in modality_cfg.keys.items():
        if column is None:  # kind switched off
            continue
        if kind not in MEDIA_KINDS:
            raise RelaxUserError(
                f"modality.keys.{kind}: {kind!r} is not an input kind; keys map one of {list(MEDIA_KINDS)} "
                "to a dataset column"
            )
        if kind not in allowed:
            raise RelaxUserError(
                f"modality.keys.{kind}: modality {modality_cfg.name!r} takes no {kind} inputs "
                f"(it takes {allowed or 'text only'}); choose a modality that does"
            )


def _resolve(item: Any, base_dir: Path | None) -> Any:
    """A relative path (bare or in a ``{"path": ...}`` dict) is taken from the dataset file's folder."""
    if base_dir is None:
        return item
    if isinstance(item, str) and not Path(item).is_absolute():
        return str(base_dir / item)
    if isinstance(item, dict) and isinstance(item.get("path"), str) and not item.get("bytes"):
        path = Path(item["path"])
        return {**item, "path": str(path if path.is_absolute() else base_dir / path)}
    return item


def row_media(
    row: dict, modality_cfg: ModalityConfig, base_dir: str | Path | None = None
) -> dict[str, list[Any]]:
    """The media items of one dataset row per kind (a column may hold one item or a list; null: none).

    Raises ``KeyError(column)`` for a missing column, like the other column lookups of the loader.
    """
    base = Path(base_dir) if base_dir is not None else None
    media: dict[str, list[Any]] = {}
    for kind, column in modality_cfg.keys.items():
        if column is None:  # kind switched off
            continue
        value = get_field(row, column)
        items = [] if value is None else list(value) if isinstance(value, list) else [value]
        if items:
            media[kind] = [_resolve(item, base) for item in items]
    return media


@dataclasses.dataclass
class MediaPrompts:
    """The model folder's processor bound to the ``modality`` settings: encodes prompts with media."""

    processor: Any
    modality_cfg: Any

    @classmethod
    def from_config(cls, modality_cfg: ModalityConfig, model_path: str) -> MediaPrompts | None:
        """None for text-only runs (no ``modality.keys``), else the processor of ``model_path``."""
        if not any(column is not None for column in modality_cfg.keys.values()):
            return None
        from relax_models.processors import load_processor

        return cls(load_processor(model_path), modality_cfg)

    def row_items(self, row: dict, base_dir: str | Path | None) -> dict[str, list[Any]]:
        """The media items of one dataset row per kind (:func:`row_media` with this run's columns)."""
        return row_media(row, self.modality_cfg, base_dir)

    def encode(
        self, text: str, media: dict[str, list[Any]]
    ) -> tuple[list[int], dict[str, torch.Tensor] | None]:
        """Prompt ids with each placeholder expanded, and the tensors of the media (None without media).

        A problem with the row (a missing file, placeholders that do not match the items) is raised as
        ``ValueError`` so the loader reports its file and row (or skips it with ``data.on_error=skip``).
        """
        from relax_models.processors import build_multimodal_inputs

        # per-item preprocessing is many tiny tensor ops: extra threads only add contention (measured 1 ms
        # vs 150 ms per audio clip on a busy 2-core machine)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return build_multimodal_inputs(
                self.processor,
                text,
                modality_cfg=self.modality_cfg,
                **{KIND_ARGUMENT[k]: v for k, v in media.items()},
            )
        except RelaxUserError as err:
            raise ValueError(str(err)) from None
        finally:
            torch.set_num_threads(threads)

    def materialize(self, records: list[PromptRecord]) -> list[PromptRecord]:
        """Records whose media are turned into tensors (copies of the records; the stored ones keep only
        references, so memory stays bounded by one batch). Records without media pass through."""
        out = []
        for record in records:
            if not record.media or record.multimodal_inputs is not None:
                out.append(record)
                continue
            try:
                ids, tensors = self.encode(record.prompt_text, record.media)
            except ValueError as err:
                raise RelaxUserError(f"prompt {record.index}: {err}") from None
            if ids != record.prompt_ids:
                raise RelaxUserError(
                    f"prompt {record.index}: its media changed since the dataset was loaded "
                    f"({len(ids)} prompt tokens now, {len(record.prompt_ids)} then)"
                )
            out.append(dataclasses.replace(record, multimodal_inputs=tensors))
        return out


def placeholder_token_ids(config: Any) -> list[int]:
    """Ids of the media placeholder tokens (image/video/audio pads) of a multimodal model config."""
    keys = ("image_token_id", "video_token_id", "audio_token_id")
    return [int(v) for k in keys if (v := getattr(config, k, None)) is not None]


def multimodal_model_inputs(
    family: str, model: torch.nn.Module, batch: TrainBatch
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``input_ids`` and extra ``model.forward`` keyword arguments for ``batch`` ({} for a text-only batch).

    Rows of one prompt reference the same tensors; ``forward_kwargs`` concatenates them per row, in row
    order, which is what the model's placeholder filling expects. A media placeholder token that a policy
    *sampled* into a response has no media behind it and would break that filling (the model counts every
    placeholder), so in response positions it is fed as the pad token; its log-prob is still taken for the
    sampled id, since targets come from ``batch.input_ids``.
    """
    if not any(batch.multimodal_inputs):
        return batch.input_ids, {}
    from relax_models.families import forward_kwargs

    input_ids = batch.input_ids
    placeholders = placeholder_token_ids(model.config)
    if placeholders:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        in_response = positions.unsqueeze(0) >= batch.prompt_lens.to(input_ids.device).unsqueeze(1)
        sampled = in_response & torch.isin(input_ids, torch.tensor(placeholders, device=input_ids.device))
        if bool(sampled.any()):
            pad = getattr(model.config.get_text_config(), "pad_token_id", None) or 0
            input_ids = input_ids.masked_fill(sampled, pad)
    kwargs = forward_kwargs(
        family, batch.multimodal_inputs, input_ids=input_ids, config=model.config, device=input_ids.device
    )
    return input_ids, kwargs


def check_engine_takes_media(cfg: RelaxConfig) -> None:
    """The rollout engine takes the run's media kinds (each engine class says which); the memory doctor asks
    too, before it sizes the run."""
    media = [kind for kind, column in cfg.modality.keys.items() if column is not None]
    if media:
        from relax_core.engines import ENGINES

        ENGINES.load(cfg.rollout.engine).check_media(media, cfg.rollout, cfg.modality.name)


def validate_model_and_modality(cfg: RelaxConfig) -> None:
    """Before Ray starts: the model family exists and can take ``modality``, ``modality.keys`` fit it, a
    model without a tiny spec has ``model.path`` and a run without a synthetic task has a dataset file."""
    from relax_models.families import check_modality, get_family

    family = get_family(cfg.model.family)
    try:
        check_modality(family.name, cfg.modality.name)
    except RelaxUserError:
        raise RelaxUserError(
            f"modality={cfg.modality.name} does not fit model={cfg.model.name}: model family {family.name} "
            f"takes {family.modalities}; choose one of those or a model family that takes "
            f"{cfg.modality.name}"
        ) from None
    check_modality_keys(cfg.modality)
    check_engine_takes_media(cfg)
    if not cfg.model.path and cfg.model.tiny is None:
        raise RelaxUserError(
            f"model={cfg.model.name} needs its weights: set model.path=/path/to/hf/folder "
            f"(e.g. a local copy of {family.examples[0] if family.examples else 'the checkpoint'})"
        )
    if not cfg.data.train_path and not cfg.data.synthetic:
        raise RelaxUserError(
            "data.train_path is required (data.synthetic is null): give a dataset file, glob, save_to_disk "
            "folder or cached Hugging Face dataset name"
        )
