"""Teacher role (on-policy distillation): a frozen model that scores the student's sampled tokens.

Any HF folder whose tokenizer matches the student's works (``algorithm.teacher.path``). With no path, the
default digits teacher — a larger tiny Qwen3 trained supervised on the task — is built once into a cache
folder by :func:`ensure_default_teacher` (also what ``scripts/train_teacher.py`` runs).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import random
import time
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from relax_core.algorithms.masked import masked_mean
from relax_core.data.prompts import render_prompt
from relax_core.data.synthetic import SYNTHETIC_TASKS
from relax_core.databus import DataBus
from relax_core.errors import RelaxUserError
from relax_core.roles.scorer import FrozenScorer
from relax_core.samples import Sample, TrainBatch
from relax_models.cache import build_once, cache_root
from relax_models.loader import load_tokenizer

if TYPE_CHECKING:
    from relax_core.config.schema import DataConfig, RelaxConfig, TeacherConfig

log = logging.getLogger("relax")


class Teacher(FrozenScorer):
    """Scores with ``algorithm.teacher.path`` through the torch backend, whatever the student trains on."""

    stage = "teacher"
    column = "teacher_logprobs"

    def __init__(
        self, cfg: RelaxConfig, teacher_path: str, bus: DataBus | None = None, sharded: bool = False
    ) -> None:
        super().__init__(cfg, teacher_path, "torch", cfg.trainer, bus, sharded)


def check_tokenizer_match(student_path: str, teacher_path: str) -> None:
    """Distillation compares per-token log-probs, so both models must share one vocabulary."""
    student, teacher = load_tokenizer(student_path), load_tokenizer(teacher_path)
    if student.get_vocab() != teacher.get_vocab():
        raise RelaxUserError(
            f"algorithm.teacher.path={teacher_path!r}: its tokenizer differs from the student's "
            f"({len(teacher)} vs {len(student)} tokens); on-policy distillation needs the same vocabulary"
        )


def teacher_recipe(teacher_cfg: TeacherConfig, data_cfg: DataConfig, seed: int) -> dict:
    """Everything that determines the default teacher's weights (its cache key)."""
    return {
        "version": 2,  # 2: trained through TorchBackend (linear decay to a tenth, AdamW foreach)
        "task": data_cfg.synthetic,
        "min_digits": data_cfg.min_digits,
        "max_digits": data_cfg.max_digits,
        "apply_chat_template": data_cfg.apply_chat_template,
        "system_prompt": data_cfg.system_prompt,
        "hidden_size": teacher_cfg.hidden_size,
        "num_hidden_layers": teacher_cfg.num_hidden_layers,
        "train_steps": teacher_cfg.train_steps,
        "train_batch_size": teacher_cfg.train_batch_size,
        "train_lr": teacher_cfg.train_lr,
        "seed": seed,
    }


def default_cache_dir(teacher_cfg: TeacherConfig) -> Path:
    return (Path(teacher_cfg.cache_dir).expanduser() if teacher_cfg.cache_dir else cache_root()) / "teachers"


def resolve_teacher_path(cfg: RelaxConfig) -> str:
    """``algorithm.teacher.path`` if set (must be a model folder); else the cached default teacher."""
    t = cfg.algorithm.teacher
    if t.path:
        if not (Path(t.path).expanduser() / "config.json").is_file():
            raise RelaxUserError(
                f"algorithm.teacher.path={t.path!r} is not a model folder (no config.json there)"
            )
        return str(Path(t.path).expanduser())
    if not cfg.data.synthetic:
        raise RelaxUserError(
            "algorithm.teacher.path is null but the data is not a built-in task: set algorithm.teacher.path "
            "to a teacher model folder"
        )
    return str(ensure_default_teacher(t, cfg.data, seed=0))


def ensure_default_teacher(
    teacher_cfg: TeacherConfig, data_cfg: DataConfig, seed: int = 0, folder: str | Path | None = None
) -> Path:
    """Train the default task teacher into ``folder`` (default: the cache) unless it is already there.

    Idempotent: the folder holds ``relax_teacher.json`` with the recipe; a matching one is reused. The model
    is trained in a temporary sibling and renamed into place, so concurrent runs never see half a teacher.
    """
    recipe = teacher_recipe(teacher_cfg, data_cfg, seed)
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:10]
    folder = Path(folder) if folder else default_cache_dir(teacher_cfg) / f"{data_cfg.synthetic}-{key}"

    def is_built(f: Path) -> bool:
        marker = f / "relax_teacher.json"
        return marker.is_file() and json.loads(marker.read_text()).get("recipe") == recipe

    def train(scratch: Path) -> None:
        log.info(
            "training the default %s teacher into %s (once; reused afterwards)", data_cfg.synthetic, folder
        )
        report = train_task_teacher(teacher_cfg, data_cfg, seed, scratch)
        (scratch / "relax_teacher.json").write_text(json.dumps({"recipe": recipe, **report}, indent=1))

    return build_once(folder, is_built, train)


def train_task_teacher(teacher_cfg: TeacherConfig, data_cfg: DataConfig, seed: int, folder: Path) -> dict:
    """Supervised training of a tiny Qwen3 on the synthetic task's (prompt, label) pairs; writes an HF folder.

    Loss: token-mean negative log-likelihood of ``label + <eos>`` after the rendered prompt — the same
    prompt text the student sees (``relax_core.data.prompts.render_prompt``). Returns accuracy and timing.
    """
    # imported here: every launch imports this module, few train a teacher (the model code costs ~0.8 s)
    from relax_core.backends.torch_backend import TorchBackend
    from relax_models.tiny import build_tiny_qwen3

    start = time.perf_counter()
    if data_cfg.synthetic not in SYNTHETIC_TASKS:
        raise RelaxUserError(f"no default teacher for data.synthetic={data_cfg.synthetic!r}")
    make_row = SYNTHETIC_TASKS[data_cfg.synthetic]
    hidden, layers = teacher_cfg.hidden_size, teacher_cfg.num_hidden_layers
    heads = 4
    build_tiny_qwen3(
        folder,
        seed=seed,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        head_dim=hidden // heads,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    (folder / "relax_tiny.json").unlink(missing_ok=True)
    tokenizer = load_tokenizer(str(folder))
    steps = max(teacher_cfg.train_steps, 1)
    # AdamW (torch defaults) with the learning rate decaying linearly to a tenth over the steps
    optimizer_cfg = SimpleNamespace(
        lr=teacher_cfg.train_lr,
        weight_decay=0.01,
        betas=(0.9, 0.999),
        grad_clip=1.0,
        lr_decay="linear",
        lr_warmup_steps=0,
        min_lr_ratio=0.1,
        total_steps=steps,
        share_prompts=False,  # supervised rows: one per prompt
    )
    model_cfg = SimpleNamespace(
        family="qwen3", dtype="float32", attn_implementation="sdpa", gradient_checkpointing=False
    )
    backend = TorchBackend(str(folder), optimizer_cfg, model_cfg)
    rng = random.Random(seed + 12345)
    eos = tokenizer.eos_token_id

    def encode(row: dict) -> tuple[list[int], list[int]]:
        prompt = tokenizer(render_prompt(row["prompt"], tokenizer, data_cfg), add_special_tokens=False)
        return prompt.input_ids, tokenizer(str(row["label"]), add_special_tokens=False).input_ids + [eos]

    def nll(micro: TrainBatch, logprobs: torch.Tensor, entropy: torch.Tensor):
        return -masked_mean(logprobs, micro.loss_mask), {}

    torch.manual_seed(seed)
    loss_value = float("nan")
    for _ in range(steps):
        samples = []
        for i in range(teacher_cfg.train_batch_size):
            prompt_ids, target = encode(make_row(rng, data_cfg))
            samples.append(Sample(i, 0, prompt_ids, target, [0.0] * len(target), [1] * len(target)))
        batch = TrainBatch.from_samples(samples, tokenizer.pad_token_id)
        loss_value = backend.train_step(batch, nll, micro_batch_size=len(batch))["loss"]
    model = backend.model
    model.eval()
    backend.export_hf(str(folder))
    accuracy = greedy_accuracy(model, tokenizer, [make_row(rng, data_cfg) for _ in range(64)], encode)
    report = {
        "final_nll": loss_value,
        "greedy_accuracy": accuracy,
        "train_seconds": time.perf_counter() - start,
        "spec": dataclasses.asdict(teacher_cfg)
        if dataclasses.is_dataclass(teacher_cfg)
        else dict(teacher_cfg),
    }
    log.info(
        "teacher trained in %.1fs: nll %.4f, greedy accuracy %.3f",
        report["train_seconds"],
        loss_value,
        accuracy,
    )
    return report


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows: list[dict], encode) -> float:
    """Share of rows whose greedy continuation (up to ``<eos>``) equals the label exactly (one batch)."""
    prompts = [encode(row)[0] for row in rows]
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = (
        torch.arange(width).unsqueeze(0) >= torch.tensor([width - len(p) for p in prompts]).unsqueeze(1)
    ).long()
    longest = max(len(encode(row)[1]) for row in rows) + 1
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=longest,
        do_sample=False,
        pad_token_id=pad,
        eos_token_id=tokenizer.eos_token_id,
    )
    texts = tokenizer.batch_decode(out[:, width:].tolist(), skip_special_tokens=True)
    return sum(text.strip() == str(row["label"]) for text, row in zip(texts, rows, strict=True)) / len(rows)
