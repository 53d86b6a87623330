"""Memory each GPU (or, on a CPU run, each role process) will hold, predicted from the config alone.

Inputs: the model's ``config.json`` (``model.path``), else the ``model.tiny`` spec, else the published
architecture of the named checkpoint (:data:`PUBLISHED`); the composed config; the cluster shape. No model
is built and no weight is read. The arithmetic follows what the code allocates:

- trainable roles (Actor, Critic) keep fp32 master weights, fp32 gradients and two fp32 AdamW moments
  (backends/torch_backend.py); FSDP divides all three by ``trainer.dp_size``; megatron holds the model in
  ``model.dtype`` plus fp32 main params, gradients and moments, each divided over tensor/expert ranks;
  with ``trainer.lora.rank`` (torch/FSDP policy) the base stays in fp32, frozen, and only the adapters
  (``rank x (in + out)`` per adapted ``target_modules`` layer, relax_models/lora.py) get gradients and
  AdamW state;
- activations at ``trainer.micro_batch_size`` rows of ``data.max_prompt_len + rollout.max_new_tokens``
  tokens (rows are right-padded to the longest), or, with ``trainer.max_tokens_per_micro_batch`` (torch
  backend), at that many tokens (a longer row trains alone), per layer everything the backward keeps, or
  only the layer inputs plus one recomputed layer with ``model.gradient_checkpointing``;
- logit buffers: the model's ``[B, L, V]`` logits (packed Qwen3 rows: only the response positions'), the
  ``[B, R, V]`` response positions gathered from them, and the fp32 work of ``algorithms/logprobs.py``:
  several fp32 copies of the response positions (cast, log-softmax, its exp, and their gradients) below
  ``CHUNK_BYTES``, above it four fp32 buffers of one chunk (and, packed, the logits' gradient);
- the torch engine's KV cache: ``[layers, slots, kv_heads, T, head_dim]`` twice, slots = the samples it is
  sent (at most ``rollout.max_running``, at least 8), T = prompt + response rounded up to 64
  (engines/torch_engine.py), at most ``rollout.kv_cache_tokens`` slots x T when that is set; vLLM/SGLang
  reserve ``rollout.memory_fraction`` of their GPU;
- in colocate the engines keep their memory while the trainer steps, so a shared GPU holds both.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GB = 1e9
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# what one process costs before it holds a model: the CUDA context on its GPU, or on a CPU run the
# interpreter with torch, transformers and Ray's worker loaded (RSS, measured by benchmarks/memory.py)
GPU_RUNTIME_BYTES = 0.5 * GB
CPU_RUNTIME_BYTES = 0.43 * GB

# config.json fields of the published checkpoints the shipped model configs name, for a doctor run without
# the folder (model.path null): Qwen/Qwen3-4B, Qwen/Qwen3-30B-A3B, Qwen/Qwen3-VL-4B-Instruct,
# Qwen/Qwen3-VL-30B-A3B-Instruct, Qwen/Qwen3-Omni-30B-A3B-Instruct (its thinker, the part Relax trains)
_QWEN3_4B = {
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
_QWEN3_30B_A3B = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}
_VL_VISION_4B = {"depth": 24, "hidden_size": 1024, "intermediate_size": 4096}
_VL_VISION_30B = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304}
PUBLISHED: dict[str, dict[str, Any]] = {
    "qwen3_4b": _QWEN3_4B,
    "qwen3_30b_a3b": _QWEN3_30B_A3B,
    "qwen3_vl_4b": {"text_config": _QWEN3_4B, "vision_config": _VL_VISION_4B},
    "qwen3_vl_30b_a3b": {"text_config": _QWEN3_30B_A3B, "vision_config": _VL_VISION_30B},
    "qwen3_omni_30b_a3b": {
        "thinker_config": {
            "text_config": {**_QWEN3_30B_A3B, "vocab_size": 152064},
            "vision_config": _VL_VISION_30B,
            "audio_config": {"encoder_layers": 32, "d_model": 1280, "encoder_ffn_dim": 5120},
        }
    },
}


@dataclass(frozen=True)
class Arch:
    """The sizes memory depends on."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    # vision / audio encoders (dense, trained with the model)
    tower_params: int = 0
    # their linear layers LoRA's target_modules may name: (attribute name, in, out, count)
    tower_linears: tuple[tuple[str, int, int, int], ...] = ()

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def expert_params(self) -> int:
        """Parameters of the routed experts (megatron spreads them over expert ranks)."""
        return self.num_layers * self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def params(self) -> int:
        h = self.hidden_size
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h + 2 * self.head_dim
        mlp = h * self.num_experts if self.num_experts else 3 * h * self.intermediate_size
        layer = attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + self.expert_params + embed + h + self.tower_params

    def decoder_linears(self) -> list[tuple[str, int, int, int]]:
        """A decoder layer's ``nn.Linear`` layers, by attribute name: (name, in, out, layers). MoE experts
        are fused 3-D parameters in transformers 5 (no ``nn.Linear``; the router is ``gate``), so a MoE
        layer offers its attention projections only."""
        h, q, kv, n = self.hidden_size, self.q_dim, self.kv_dim, self.num_layers
        out = [("q_proj", h, q, n), ("k_proj", h, kv, n), ("v_proj", h, kv, n), ("o_proj", q, h, n)]
        if not self.num_experts:
            i = self.intermediate_size
            out += [("gate_proj", h, i, n), ("up_proj", h, i, n), ("down_proj", i, h, n)]
        return out

    def linears(self) -> list[tuple[str, int, int, int]]:
        """Every ``nn.Linear`` LoRA's ``target_modules`` can name (the LM head is ``lm_head``, never a
        target): the decoder's and the encoder towers'."""
        return self.decoder_linears() + list(self.tower_linears)

    def lora_params(self, rank: int, target_modules: Any) -> int:
        """Adapter parameters ``apply_lora`` adds: ``rank x (in + out)`` per adapted layer."""
        targets = set(target_modules)
        return rank * sum(count * (i + o) for name, i, o, count in self.linears() if name in targets)

    def activation_bytes(self, compute_bytes: int, residual_bytes: int, autocast: bool) -> int:
        """Bytes one token leaves per decoder layer for the backward (counted with saved-tensor hooks on
        Qwen3 layers, and matched on a GPU: docs/performance.md). Each RMSNorm keeps its input and its
        normalised output at the residual stream's width (fp32 under autocast over fp32 weights); the
        projections keep their inputs in the compute dtype, one copy per projection under autocast (each
        casts its own), else one for q/k/v and one for gate/up; q and k are kept in fp32 by their norms
        and three times in the compute dtype (with v: norm, rotary, attention), plus the attention's
        log-sum-exp per head; the MLP keeps gate, up, activation and product (the routed experts' for
        MoE, and the router's scores)."""
        cb, h = compute_bytes, self.hidden_size
        mlp = (
            self.experts_per_token * self.moe_intermediate_size
            if self.num_experts
            else self.intermediate_size
        )
        norms = 4 * h * residual_bytes + (5 if autocast else 2) * h * cb
        attention = (4 + 3 * cb) * (self.q_dim + self.kv_dim) + 4 * self.num_heads
        return norms + attention + 4 * cb * mlp + cb * self.num_experts

    def decode_weight_bytes(self, dtype_bytes: int) -> int:
        """The torch engine's decode layout of a dense Qwen3 (engines/torch_engine.py ``_layer_weights``):
        fused [q; k; v] and [gate; up] copies of those projections beside the model's own weights."""
        if self.num_experts:
            return 0
        h = self.hidden_size
        return self.num_layers * h * (self.q_dim + 2 * self.kv_dim + 2 * self.intermediate_size) * dtype_bytes


def _tower_linears(cfg: dict[str, Any]) -> list[tuple[str, int, int, int]]:
    """The dense encoder towers' per-block linear layers (Qwen3-VL vision blocks, the Omni audio encoder's
    layers), named as transformers names them."""
    out = []
    vision = cfg.get("vision_config") or {}
    if vision:
        h, i = vision.get("hidden_size", 0), vision.get("intermediate_size", 0)
        n = vision.get("depth", vision.get("num_hidden_layers", 0))
        out += [("qkv", h, 3 * h, n), ("proj", h, h, n), ("linear_fc1", h, i, n), ("linear_fc2", i, h, n)]
    audio = cfg.get("audio_config") or {}
    if audio:
        d = audio.get("d_model", audio.get("hidden_size", 0))
        ffn = audio.get("encoder_ffn_dim", audio.get("intermediate_size", 0))
        n = audio.get("encoder_layers", audio.get("num_hidden_layers", 0))
        out += [(name, d, d, n) for name in ("q_proj", "k_proj", "v_proj", "out_proj")]
        out += [("fc1", d, ffn, n), ("fc2", ffn, d, n)]
    return out


def _tower_params(cfg: dict[str, Any]) -> int:
    """Dense encoder towers: depth x (attention 4h^2 + MLP 2hI)."""
    return sum(count * i * o for _, i, o, count in _tower_linears(cfg))


def arch_from_config(cfg: dict[str, Any]) -> Arch:
    """An :class:`Arch` from a ``config.json`` dict (dense, MoE, VL's ``text_config``, Omni's thinker)."""
    cfg = cfg.get("thinker_config", cfg)
    text = cfg.get("text_config") or cfg
    heads = text["num_attention_heads"]
    return Arch(
        vocab_size=text["vocab_size"],
        hidden_size=text["hidden_size"],
        num_layers=text["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=text.get("num_key_value_heads") or heads,
        head_dim=text.get("head_dim") or text["hidden_size"] // heads,
        intermediate_size=text.get("intermediate_size", 0),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        num_experts=text.get("num_experts") or text.get("num_local_experts") or 0,
        experts_per_token=text.get("num_experts_per_tok", 0) or 0,
        moe_intermediate_size=text.get("moe_intermediate_size", 0) or 0,
        tower_params=_tower_params(cfg),
        tower_linears=tuple(_tower_linears(cfg)),
    )


def model_arch(model_cfg: Any) -> tuple[Arch, str]:
    """The architecture a run will load, and where it was read from."""
    if model_cfg.path:
        file = Path(model_cfg.path).expanduser() / "config.json"
        if file.is_file():
            return arch_from_config(json.loads(file.read_text(encoding="utf-8"))), str(file)
    if model_cfg.tiny is not None:
        from relax_models.tokenizer import CHARACTERS, SPECIAL_TOKENS

        spec = model_cfg.tiny if isinstance(model_cfg.tiny, dict) else dataclasses.asdict(model_cfg.tiny)
        # the character tokenizer the tiny builders use (multimodal twins add a few marker tokens)
        text = {k: v for k, v in spec.items() if k not in ("vision", "audio")}
        text["vocab_size"] = len(SPECIAL_TOKENS) + len(set(CHARACTERS))
        return arch_from_config(text), f"model.tiny of {model_cfg.name}"
    if model_cfg.name in PUBLISHED:
        return arch_from_config(PUBLISHED[model_cfg.name]), f"published config.json of {model_cfg.name}"
    from relax_core.errors import RelaxUserError

    raise RelaxUserError(
        f"model {model_cfg.name!r} has no architecture to size: set model.path to its folder (config.json)"
    )


@dataclass
class RoleMemory:
    """What one role (or one rank of it) holds on one device, in bytes per item."""

    role: str
    items: dict[str, float]
    # activations with the other gradient-checkpointing setting (trainable roles)
    other_activations: float | None = None
    checkpointing: bool = False
    # items never held together with the activations and logits: the torch backend's gradients when a
    # step is one micro-batch (set to None before the forward, made by the backward as it frees the graph)
    apart: tuple[str, ...] = ()

    @property
    def total(self) -> float:
        held = sum(self.items.values())
        if not self.apart:
            return held
        graph = self.items.get("activations", 0.0) + self.items.get("logits", 0.0)
        return held - min(sum(self.items[k] for k in self.apart), graph)


@dataclass
class Device:
    """One GPU, or one role process on a CPU run."""

    name: str
    roles: list[RoleMemory] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(r.total for r in self.roles)


# the setting that shrinks each item
HINTS = {
    "weights": "shard the trainer (trainer=fsdp trainer.dp_size=N, or trainer.megatron.tensor) or use more GPUs",
    "gradients": "shard the trainer (trainer=fsdp trainer.dp_size=N, or trainer.megatron.tensor)",
    "optimizer": "shard the trainer (trainer=fsdp trainer.dp_size=N, or trainer.megatron.tensor), "
    "or train LoRA adapters (trainer.lora.rank=8)",
    "activations": "set model.gradient_checkpointing=true or lower trainer.micro_batch_size "
    "(trainer.max_tokens_per_micro_batch)",
    "logits": "lower trainer.micro_batch_size or trainer.max_tokens_per_micro_batch (or rollout.max_new_tokens)",
    "kv_cache": "set rollout.kv_cache_tokens (or lower rollout.max_running, the samples decoded at once) or "
    "lower rollout.max_new_tokens, or set rollout.dtype=bfloat16",
    "engine_weights": "set rollout.dtype=bfloat16 or rollout.tensor_parallel_size",
    "reserved": "lower rollout.memory_fraction",
    "sampling": "lower rollout.max_running",
    "transfer": "lower weight_transfer.bucket_mb",
    "runtime": "use fewer processes per GPU",
}


@dataclass
class MemoryReport:
    arch: Arch
    source: str
    gpu: bool
    capacity: float | None
    devices: list[Device]
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.capacity is None or all(d.total <= self.capacity for d in self.devices)

    def largest(self) -> tuple[Device, RoleMemory, str, float]:
        """The fullest device, and its largest item."""
        device = max(self.devices, key=lambda d: d.total)
        return max(
            ((device, r, item, size) for r in device.roles for item, size in r.items.items()),
            key=lambda x: x[3],
        )

    def problem(self) -> str | None:
        """One line naming the largest item of the fullest device and the setting that shrinks it."""
        if self.fits:
            return None
        device, role, item, size = self.largest()
        return (
            f"{device.name} would need {device.total / GB:.1f} GB but cluster.gpu_memory_gb="
            f"{self.capacity / GB:g}: the largest item is {role.role}'s {item.replace('_', ' ')} "
            f"({size / GB:.1f} GB); {HINTS[item]} (python -m relax_launch.doctor <overrides> prints the table)"
        )

    def table(self) -> str:
        a = self.arch
        unit = "GPU" if self.gpu else "CPU process"
        lines = [
            f"model: {a.params / 1e6:,.1f} M parameters ({self.source}); hidden {a.hidden_size}, "
            f"{a.num_layers} layers, {a.num_heads}/{a.num_kv_heads} heads, vocab {a.vocab_size}"
            + (f", {a.num_experts} experts (top {a.experts_per_token})" if a.num_experts else ""),
            f"{len(self.devices)} {unit}(s)"
            + (f" of {self.capacity / GB:g} GB (cluster.gpu_memory_gb)" if self.capacity else "")
            + "; GB = 1e9 bytes",
        ]
        groups: list[tuple[list[str], Device]] = []
        for device in self.devices:  # identical devices (ranks of one group) print once
            key = _signature(device)
            match = next((g for g in groups if _signature(g[1]) == key), None)
            if match:
                match[0].append(device.name)
            else:
                groups.append(([device.name], device))
        for names, device in groups:
            head = names[0] if len(names) == 1 else f"{', '.join(names)} (each)"
            lines.append(f"{head}: {device.total / GB:.2f} GB")
            for role in device.roles:
                parts = ", ".join(f"{k} {v / GB:.2f}" for k, v in role.items.items())
                if role.other_activations is not None:
                    other = "without" if role.checkpointing else "with"
                    parts += f" (activations {other} checkpointing: {role.other_activations / GB:.2f})"
                if role.apart:  # the total counts the larger of the two
                    parts += f"; {', '.join(role.apart)} never held with the activations (one micro-batch)"
                lines.append(f"  {role.role:<28} {role.total / GB:8.2f}  {parts}")
        lines += [f"note: {n}" for n in self.notes]
        if self.capacity is None:
            lines.append("verdict: CPU run, nothing to refuse (per-process RSS predictions above)")
        else:
            worst = max(d.total for d in self.devices)
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(f"verdict: {verdict} (fullest {unit} {worst / GB:.1f} of {self.capacity / GB:g} GB)")
            if not self.fits:
                lines.append(f"  {self.problem()}")
        return "\n".join(lines)


def _signature(device: Device) -> tuple:
    return tuple((r.role.split(" ")[0], tuple(round(v) for v in r.items.values())) for r in device.roles)


def uses_gpus(cfg: Any) -> bool:
    """A GPU run: a role asks for GPUs (validation refuses a GPU cluster whose roles ask for none)."""
    return cfg.rollout.num_gpus > 0 or cfg.trainer.num_gpus > 0


def _shards(cfg: Any, arch: Arch) -> tuple[float, str]:
    """Parameters one trainer rank holds, and how they are split."""
    t = cfg.trainer
    if t.backend == "megatron":
        m = t.megatron
        etp = m.expert_tensor or m.tensor
        dense = (arch.params - arch.expert_params) / (m.tensor * m.pipeline)
        return dense + arch.expert_params / (
            m.expert * etp * m.pipeline
        ), f"megatron tp{m.tensor} ep{m.expert}"
    if t.fsdp:
        return arch.params / t.dp_size, f"fsdp/{t.dp_size}"
    return float(arch.params), "torch"


def _seq(cfg: Any) -> tuple[int, int]:
    """Longest prompt and response of a row."""
    return cfg.data.max_prompt_len, cfg.rollout.max_new_tokens


# families whose micro-batches the torch backend packs into one padding-free sequence
# (torch_backend.PACKED_FAMILIES; not imported: that module loads transformers)
PACKED_FAMILIES = ("qwen3", "qwen3_moe")


def _token_budget(cfg: Any, role: str) -> tuple[float | None, bool]:
    """With ``trainer.max_tokens_per_micro_batch`` (torch backend, FSDP too; not the Critic, whose backend
    takes ``algorithm.critic.micro_batch_size`` rows): the rows of a micro-batch at full length that its
    budget holds (fractional: the budget's tokens are what counts; a row longer than the budget trains
    alone), and whether the rows are packed (Qwen3 text: logits only at response positions). Else
    ``(None, False)``. Exact for rows at full length; ``pack_rows`` keeps a group's rows x its longest
    response, so a group of many short responses beside one long one holds more logits than sized here."""
    t = cfg.trainer
    budget = t.max_tokens_per_micro_batch
    if not budget or t.backend != "torch" or role.startswith("critic"):
        return None, False
    length = sum(_seq(cfg))
    packed = cfg.model.family in PACKED_FAMILIES and cfg.modality.name == "text"
    return max(budget, length) / length, packed


def _lora(cfg: Any, role: str) -> Any:
    """``trainer.lora`` when the policy trains adapters (torch/FSDP; the Critic never does), else None."""
    lora = getattr(cfg.trainer, "lora", None)
    if lora is None or not lora.rank or cfg.trainer.backend != "torch" or not role.startswith("actor"):
        return None
    return lora


def _lora_activation_bytes(arch: Arch, lora: Any, cb: int) -> float:
    """What the adapters add per token and decoder layer for the backward: the rank-wide ``x Aᵀ`` of each
    adapted layer, and with dropout its dropped input and mask (the base layer's input is shared)."""
    targets = set(lora.target_modules)
    per_layer = [(i, o) for name, i, o, _ in arch.decoder_linears() if name in targets]
    extra = len(per_layer) * lora.rank * cb
    if lora.dropout:
        extra += sum(i for i, _ in per_layer) * (cb + 1)
    return float(extra)


def _activations(
    cfg: Any,
    arch: Arch,
    rows: float,
    dtypes: tuple[int, int, bool],
    checkpointing: bool,
    tp: int,
    extra: float = 0.0,
) -> float:
    """``dtypes``: compute and residual-stream bytes and whether autocast casts (``_dtypes``); ``extra``:
    bytes per token and layer beyond the layer's own (LoRA's)."""
    prompt, response = _seq(cfg)
    tokens = rows * (prompt + response)
    per_layer = arch.activation_bytes(*dtypes) / tp + extra
    if checkpointing:  # layer inputs kept, one layer recomputed at a time
        return tokens * (arch.num_layers * arch.hidden_size * dtypes[1] + per_layer)
    return tokens * arch.num_layers * per_layer


def _one_micro_batch(cfg: Any, rows: float) -> bool:
    """Whether a rank's rows of an optimizer step fit in one micro-batch of ``rows``."""
    from relax_core.runtime.placement import data_parallel_size

    r = cfg.rollout
    return math.ceil(r.batch_size * r.n_samples_per_prompt / data_parallel_size(cfg.trainer)) <= rows


def _dtypes(cfg: Any, cb: int, trainable: bool) -> tuple[int, int, bool]:
    """Compute bytes, residual-stream bytes and autocast of a trainer role's forward: the torch backend
    trains fp32 weights under a ``model.dtype`` autocast (fp32 residual stream, a cast per projection);
    FSDP's mixed precision and megatron run the forward on weights of that dtype; frozen roles hold it."""
    t = cfg.trainer
    autocast = trainable and cb < 4 and t.backend == "torch" and not t.fsdp
    return cb, 4 if autocast else cb, autocast


def _logits(cfg: Any, arch: Arch, rows: float, cb: int, backward: bool, packed: bool = False) -> float:
    """Logit buffers at their peak (algorithms/logprobs.py). Padded rows: the model's ``[B, L, V]``
    logits plus the ``[B, R, V]`` response positions gathered from them; packed rows: the model computes
    only the ``B·R`` response positions. Then, at up to ``CHUNK_BYTES`` of fp32 ``[B·R, V]`` work, the
    plain autograd path: fp32 copies of all response positions (cast, log-softmax, exp, their product;
    three more in the backward). Above it the chunked path: the forward holds four fp32 ``[rows, V]``
    buffers of one chunk (cast, log-softmax, exp, product) and saves only the logits; its backward writes
    one ``[B·R, V]`` gradient in the logits' dtype beside them (at most three chunk buffers), by which
    time padded rows' full logits are gone (the gather's gradient then takes their place)."""
    from relax_core.algorithms.logprobs import CHUNK_BYTES

    prompt, response = _seq(cfg)
    v = arch.vocab_size
    positions = rows * response
    full = 0.0 if packed else rows * (prompt + response) * v * cb
    chunk_rows = max(1, CHUNK_BYTES // (4 * v))
    if positions <= chunk_rows:  # unchunked
        copies = 3 + 3 * backward
        return full + positions * v * (cb + 4 * copies)
    chunk = chunk_rows * v * 4
    if packed and backward:  # the saved logits and their gradient; three chunk buffers
        return 2 * positions * v * cb + 3 * chunk
    return full + positions * v * cb + 4 * chunk


def trainer_memory(cfg: Any, arch: Arch, role: str, trainable: bool, rows: int | None = None) -> RoleMemory:
    """One rank of a model-holding trainer role (Actor, Critic, Reference, Teacher, ActorFwd)."""
    t, m = cfg.trainer, cfg.model
    cb = DTYPE_BYTES.get(m.dtype, 4)
    params, how = _shards(cfg, arch)
    megatron = t.backend == "megatron"
    tp = t.megatron.tensor if megatron else 1
    budget_rows, packed = _token_budget(cfg, role)
    rows = budget_rows or rows or t.micro_batch_size
    if budget_rows:
        how += f", {t.max_tokens_per_micro_batch} tokens/micro-batch" + (" packed" if packed else "")
    ckpt = bool(m.gradient_checkpointing)
    apart: tuple[str, ...] = ()
    if trainable:
        dtypes = _dtypes(cfg, cb, True)
        lora = _lora(cfg, role)
        # LoRA: the frozen base in fp32 beside fp32 adapters, sharded alike; only the adapters train
        adapters = arch.lora_params(lora.rank, lora.target_modules) if lora else 0
        trained = adapters * params / arch.params if lora else params
        held = params + trained if lora else params
        weights = held * (cb + 4 if megatron and cb < 4 else 4)  # megatron: model dtype + fp32 main params
        # autocast keeps a model.dtype copy of each weight through the backward (frozen ones too: the
        # backward to the adapters below needs it)
        if not megatron and cb < 4:
            weights += (arch.params / arch.num_layers * 2 if t.fsdp else params) * cb
        extra = _lora_activation_bytes(arch, lora, cb) if lora else 0.0
        items = {
            "weights": weights,
            "gradients": trained * 4,
            "optimizer": trained * 8,
            "activations": _activations(cfg, arch, rows, dtypes, ckpt, tp, extra),
        }
        other = _activations(cfg, arch, rows, dtypes, not ckpt, tp, extra)
        if lora:
            how += f", LoRA r{lora.rank}: {adapters / 1e6:,.1f} M trained"
        if not megatron and _one_micro_batch(cfg, rows):  # megatron's gradient buffers persist
            apart = ("gradients",)
    else:
        items = {
            "weights": params * cb,
            # no graph kept: one layer's working set over the micro-batch
            "activations": _activations(cfg, arch, rows, _dtypes(cfg, cb, False), True, tp)
            / max(arch.num_layers, 1),
        }
        other = None
    if role.startswith("critic"):
        items["logits"] = 0.0  # a scalar value head
    else:
        items["logits"] = _logits(cfg, arch, rows, cb, trainable, packed)
    return RoleMemory(f"{role} ({how})", items, other, ckpt, apart)


def kv_cache_bytes(arch: Arch, tokens: int, dtype_bytes: int) -> int:
    """The torch engine's dense KV cache for ``tokens`` token slots: keys and values of every layer."""
    return 2 * arch.num_layers * tokens * arch.kv_dim * dtype_bytes


def engine_memory(cfg: Any, arch: Arch, index: int, gpu: bool, capacity: float | None) -> RoleMemory:
    """One rollout engine on one of its GPUs."""
    r = cfg.rollout
    name = "bfloat16" if r.dtype == "auto" and (gpu or r.engine != "torch") else r.dtype
    eb = DTYPE_BYTES.get(name, 4)
    tp = max(r.tensor_parallel_size, 1) if r.engine != "torch" else 1
    weights = arch.params * eb / tp
    role = f"rollout engine {index} ({r.engine}, {name})"
    if r.engine != "torch":
        from relax_core.engines.base import default_memory_fraction

        if r.kv_cache_mib is not None or not gpu:
            kv = (r.kv_cache_mib if r.kv_cache_mib is not None else 256) * 2**20
            return RoleMemory(role, {"engine_weights": weights, "kv_cache": float(kv)})
        fraction = r.memory_fraction if r.memory_fraction is not None else default_memory_fraction(r.num_gpus)
        reserved = fraction * (capacity or 0.0)
        # the server reserves its fraction; the weights come out of it, the KV cache gets the rest
        return RoleMemory(role, {"engine_weights": weights, "reserved": max(reserved - weights, 0.0)})
    prompt, response = _seq(cfg)
    # an evaluation's sampled pass can ask for more rows at once than a training step (128 prompts x 8)
    eval_samples, eval_response = _eval_demand(cfg)
    response = max(response, eval_response)
    samples = math.ceil(max(r.batch_size * r.n_samples_per_prompt, eval_samples) / r.num_engines)
    slots = max(min(r.max_running, samples), 8)
    length = -(-(prompt + response) // 64) * 64
    tokens = slots * length
    if r.kv_cache_tokens is not None:  # the engine admits only the rows of this many tokens
        tokens = min(tokens, r.kv_cache_tokens)
        slots = min(slots, max(r.kv_cache_tokens // (prompt + response), 1))
    kv = kv_cache_bytes(arch, tokens, eb)
    # per decode step: fp32 logits of every slot, softmax and sampling scratch
    sampling = slots * arch.vocab_size * 4 * 3
    fused = arch.decode_weight_bytes(eb) if _decodes_fused(cfg.model.family, cfg.modality.name) else 0
    return RoleMemory(
        role,
        {"engine_weights": weights + fused, "kv_cache": float(kv), "sampling": float(sampling)},
    )


def _eval_demand(cfg: Any) -> tuple[int, int]:
    """The most samples one evaluation pass asks the engines for at once (a set's prompts, ``limit`` or
    ``data.num_eval``, times its sampled ``n_samples``, or one greedy response each), and the longest
    response budget of the sets (evaluation runs before RL and after the last step whatever
    ``trainer.eval_every``)."""
    samples = response = 0
    for fields in (cfg.eval.sets or {}).values():
        get = fields.get if isinstance(fields, dict) else lambda key, f=fields: getattr(f, key, None)
        n = max(get("n_samples") or 0, 1 if get("greedy") is not False else 0)
        if n:
            samples = max(samples, (get("limit") or cfg.data.num_eval) * n)
            response = max(response, get("max_new_tokens") or 0)
    return samples, response


def _decodes_fused(family: str, modality: str) -> bool:
    """Whether the torch engine decodes on its fused layout (torch_engine.fast_path_supported: dense Qwen3
    text models; not imported, that module loads transformers)."""
    return family == "qwen3" and modality == "text"


def judge_memory(cfg: Any) -> RoleMemory | None:
    """One managed GenRM judge engine (``reward.judge``, relax_core/rollout/judge.py): the torch engine's weights and
    a dense KV cache of up to ``reward.judge.max_running`` rows, each a policy row plus the verdict's tokens
    (the template's own words are not counted); None without a managed judge."""
    judge = cfg.reward.judge
    if judge is None or not judge.managed:
        return None
    from types import SimpleNamespace

    if judge.path:
        arch, _ = model_arch(SimpleNamespace(path=judge.path, tiny=None, name=judge.path))
    else:
        from relax_core.rollout.judge import tiny_judge_spec

        tiny = tiny_judge_spec(judge.model)[1]
        arch, _ = model_arch(SimpleNamespace(path=None, tiny=tiny, name=judge.model))
    eb = DTYPE_BYTES.get(judge.dtype, 4)
    prompt, response = _seq(cfg)
    verdict = int((cfg.reward.kwargs.get("sampling_params") or {}).get("max_new_tokens", 16))
    rows = min(judge.max_running, cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt)
    if judge.engine == "vllm":  # vLLM's own cache, of the size it is given on the CPU where judges run
        from relax_core.engines.vllm import CPU_KV_CACHE_MIB

        weights, kv = arch.params * eb, CPU_KV_CACHE_MIB << 20
    else:  # the torch engine's decode layout (a judge is a dense Qwen3 text model) and its dense cache
        weights = arch.params * eb + arch.decode_weight_bytes(eb)
        kv = kv_cache_bytes(arch, rows * (prompt + response + verdict), eb)
    items = {"engine_weights": weights, "kv_cache": float(kv), "runtime": CPU_RUNTIME_BYTES}
    return RoleMemory(f"judge engine ({judge.engine}, {judge.dtype})", items)


def _placement(cfg: Any) -> list[list[tuple[str, str, float]]]:
    """Roles per GPU bundle: (kind, name, GPUs asked). Mirrors placement.colocate_bundles/gpu_bundles."""
    from relax_core.algorithms.spec import requirements
    from relax_core.runtime.placement import actor_world_size, helper_ranks

    r, t = cfg.rollout, cfg.trainer
    world, helpers = actor_world_size(t), helper_ranks(t)
    roles = requirements(cfg).model_roles
    if cfg.mode.name == "colocate" or cfg.cluster.name == "in_process":
        bundles = []
        for i in range(max(r.num_engines, world)):
            bundle = [("engine", f"{i}", r.num_gpus)] * (i < r.num_engines)
            if i < world:
                bundle.append(("actor", f"actor rank {i}", t.num_gpus))
                # helpers share an Actor rank's GPU: sharded over every rank with FSDP, else on rank 0
                if helpers > 1 or i == 0:
                    bundle += [
                        (role, f"{role}" + (f" rank {i}" if helpers > 1 else ""), 0.0) for role in roles
                    ]
            bundles.append(bundle)
        return bundles
    bundles = [[("engine", f"{i}", r.num_gpus)] for i in range(r.num_engines)]
    bundles += [[("actor", f"actor rank {i}", t.num_gpus)] for i in range(world)]
    for role in roles:
        bundles += [[(role, f"{role} rank {i}", t.num_gpus)] for i in range(helpers)]
    return bundles


def _role_memory(cfg: Any, arch: Arch, kind: str, name: str, gpu: bool, capacity: float | None) -> RoleMemory:
    if kind == "engine":
        return engine_memory(cfg, arch, int(name), gpu, capacity)
    if kind == "critic":
        critic = cfg.algorithm.critic
        return trainer_memory(cfg, arch, name, True, critic.micro_batch_size if critic else None)
    return trainer_memory(cfg, arch, name, kind in ("actor",))


def estimate(cfg: Any) -> MemoryReport:
    """Predicted memory per GPU (GPU run) or per role process (CPU run) of the composed config ``cfg``."""
    arch, source = model_arch(cfg.model)
    gpu = uses_gpus(cfg)
    capacity = float(getattr(cfg.cluster, "gpu_memory_gb", 80.0)) * GB if gpu else None
    notes = []
    if cfg.algorithm.teacher is not None:
        notes.append("the Teacher is sized as the policy's architecture")
    if cfg.rollout.release_memory_during_train and cfg.mode.name == "colocate":
        notes.append(
            "rollout.release_memory_during_train frees the engines' KV cache while the trainer steps; "
            "the totals still count both (an upper bound)"
        )
    if cfg.trainer.backend == "torch" and cfg.trainer.offload:
        notes.append(
            "trainer.offload frees the Actor's GPU only while engines generate; the peak is training"
        )
    transfer = cfg.weight_transfer.bucket_mb * 2**20
    devices: list[Device] = []
    bundles = _placement(cfg)
    if gpu:
        free: list[float] = []  # GPU left on each device, first fit like Ray's PACK

        def place(need: float) -> Device:
            index = next((i for i, left in enumerate(free) if need <= left + 1e-9), None)
            if index is None:
                free.append(1.0)
                devices.append(Device(f"GPU {len(devices)}"))
                index = len(devices) - 1
            free[index] -= need
            return devices[index]

        rank_gpu: Device | None = None
        for bundle in bundles:
            # roles asking for one GPU together share it (colocate's engine + Actor rank); else each its own
            asked = sum(g for _, _, g in bundle)
            shared = place(asked) if asked <= 1.0 + 1e-9 else None
            for kind, name, share in bundle:
                memory = _role_memory(cfg, arch, kind, name, gpu, capacity)
                if kind in ("engine", "actor"):
                    memory.items["transfer"] = float(transfer)
                memory.items["runtime"] = GPU_RUNTIME_BYTES
                # colocate's helpers ask for no GPU: they sit on their Actor rank's
                target = shared or (place(min(share, 1.0)) if share else rank_gpu)
                if kind == "actor":
                    rank_gpu = target
                target.roles.append(memory)
        judge = judge_memory(cfg)
        # bundles of their own (relax_core/rollout/judge.py)
        if judge is not None and cfg.reward.judge.num_gpus:
            for i in range(cfg.reward.judge.num_engines):
                engine = RoleMemory(f"{judge.role} {i}", judge.items | {"runtime": GPU_RUNTIME_BYTES})
                place(min(cfg.reward.judge.num_gpus, 1.0)).roles.append(engine)
        elif judge is not None:
            notes.append(
                f"{cfg.reward.judge.num_engines} judge engine(s) on the CPU (reward.judge.num_gpus=0), "
                f"{judge.total / GB:.2f} GB each (not in the table)"
            )
        return MemoryReport(arch, source, True, capacity, devices, notes)
    # CPU: one process per role, except in_process (all) and colocate's fused Actor + engine
    r, t = cfg.rollout, cfg.trainer
    fused = (
        cfg.mode.name == "colocate"
        and cfg.mode.fuse_rollout
        and len(bundles) == 1
        and r.engine == "torch"
        and r.num_threads == t.num_threads
    )
    one = cfg.cluster.name == "in_process"
    cb = DTYPE_BYTES.get(cfg.model.dtype, 4)
    for bundle in bundles:
        for kind, name, _ in bundle:
            memory = _role_memory(cfg, arch, kind, name, False, None)
            if kind == "actor":  # the weights it publishes: a model.dtype copy on the CPU
                memory.items["transfer"] = arch.params * cb
            if one and devices or fused and kind == "actor":
                devices[-1].roles.append(memory)
                continue
            memory.items["runtime"] = CPU_RUNTIME_BYTES
            label = "rollout engine " + name if kind == "engine" else name
            if fused and kind == "engine":
                label = "actor + rollout engine 0 (fused)"
            devices.append(Device("process " + ("(all roles)" if one else label), [memory]))
    judge = judge_memory(cfg)
    for i in range(cfg.reward.judge.num_engines if judge is not None else 0):
        devices.append(Device(f"process judge engine {i}", [judge]))
    return MemoryReport(arch, source, False, None, devices, notes)
