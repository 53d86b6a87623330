"""Low-rank adapters (LoRA) through peft: ``inject_adapter_in_model`` puts peft's ``lora.Linear`` on the
``target_modules`` layers of a plain HF model (no ``PeftModel`` wrapper, so the backends, FSDP2 and the forward
see the model they always see), ``y = x Wᵀ + b + s · dropout(x) Aᵀ Bᵀ`` with ``s = alpha / rank``, B zero at the
start. Only the adapters require grad.

Names: an adapted layer's base weight becomes ``<m>.base_layer.weight`` and its factors
``<m>.lora_A.default.weight`` / ``<m>.lora_B.default.weight``. Engines and ``final_model`` get the HF names back
(:func:`merged_weights`); adapters are saved in peft's own format (:func:`save_adapter`), which
``PeftModel.from_pretrained(base, path)`` loads.

Adapter sync (``trainer.lora.engine_sync=adapter``, engines that serve LoRA themselves: vLLM): a published
version is an *adapter payload* (:func:`adapter_payload`): the frozen base under the HF names, the adapters under
the names of peft's saved file, and two scalars, the base's version (it changes only when the base does: the
full-model warm-start, a checkpoint load) and ``alpha / rank``. Its layout is the same for every version, so
every weight-transfer channel carries it as it is; an adapter engine pushes the base into its server only when
the base version moved and the adapters every time, and every other receiver merges it (:func:`merged_payload`).
"""

from __future__ import annotations

import copy
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from relax_models.errors import RelaxUserError

if TYPE_CHECKING:
    from peft import LoraConfig

# peft is imported by the functions that build, save or load adapters: importing it costs over a second,
# which every launch and every trainer process of a run without LoRA would pay for nothing

ADAPTER = "default"  # peft's adapter name; saved files leave it out
# what PeftModel.save_pretrained puts before the HF names (its base_model.model wrapper)
PEFT_PREFIX = "base_model.model."
ADAPTER_NAMES = ("lora_A", "lora_B")
# the scalars of an adapter payload
BASE_VERSION_KEY = "relax.lora.base_version"
SCALE_KEY = "relax.lora.scale"
_PEFT_KEY = re.compile(r"^(?P<module>.+)\.(?:base_layer\.(?P<leaf>.+)|(?P<factor>lora_[AB])\.[^.]+\.weight)$")


def apply_lora(
    model: torch.nn.Module, rank: int, alpha: float, dropout: float, target_modules: list[str]
) -> LoraConfig:
    """peft adapters on every ``nn.Linear`` whose attribute name is in ``target_modules``; everything but the
    adapters frozen. Returns the peft config (what :func:`save_adapter` writes)."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    targets = set(target_modules)
    # the full names of the matching nn.Linear layers: given the bare names, peft would also wrap the fused 3-D
    # expert weights of a MoE model (gate_up_proj, down_proj), which neither the merge nor the doctor count
    found = [
        name
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in targets and isinstance(module, torch.nn.Linear)
    ]
    if not found:
        raise RelaxUserError(
            f"trainer.lora.target_modules={sorted(targets)} matches no linear layer of the model; "
            "name the model's projection layers (e.g. q_proj, v_proj)"
        )
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=found)
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    if dropout:
        for module in model.modules():
            if isinstance(module, LoraLayer):
                module.lora_dropout[ADAPTER] = GradOnlyDropout(dropout)
    return config


class GradOnlyDropout(torch.nn.Dropout):
    """peft's adapter dropout on the training forward only: scoring passes (no grad) of the policy, which
    stays in train mode, see the deterministic adapters."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if torch.is_grad_enabled() else x


def lora_scales(model: torch.nn.Module) -> dict[str, float]:
    """``{adapted layer name: alpha / rank}`` (peft's ``scaling``)."""
    if "peft" not in sys.modules:  # nothing imported peft, so no layer can be one of its adapters
        return {}
    from peft.tuners.lora import LoraLayer

    return {name: m.scaling[ADAPTER] for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def is_adapter(name: str) -> bool:
    """Whether a state-dict key names an adapter factor."""
    return any(part in ADAPTER_NAMES for part in name.split("."))


def zero_adapters(model: torch.nn.Module) -> None:
    """B = 0: the model computes its base weights alone."""
    if "peft" not in sys.modules:
        return
    from peft.tuners.lora import LoraLayer

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoraLayer):
                module.lora_B[ADAPTER].weight.zero_()


def peft_names(weights: dict[str, torch.Tensor], scales: dict[str, float]) -> dict[str, torch.Tensor]:
    """HF-named weights under the adapted model's names (``<m>.weight`` -> ``<m>.base_layer.weight``)."""
    out = {}
    for name, tensor in weights.items():
        module, _, leaf = name.rpartition(".")
        out[f"{module}.base_layer.{leaf}" if module in scales else name] = tensor
    return out


def merged_weights(
    named: Iterable[tuple[str, torch.Tensor]], scales: dict[str, float]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's state dict from the adapted model's, in its order and under the HF names: each adapted
    ``<m>.weight`` becomes ``W + scale · B A`` (computed in fp32), the adapter keys disappear. Streams: a base
    weight waits only for its own ``lora_A``/``lora_B``, which follow it in a module's state dict."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in _base_names(named, scales):
        module, _, leaf = name.rpartition(".")
        if module not in scales or leaf not in ("weight", *ADAPTER_NAMES):
            yield name, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[leaf] = tensor
        if len(parts) == 3:
            del pending[module]
            w, a, b = parts["weight"], parts["lora_A"], parts["lora_B"]
            delta = (b.float() @ a.float()) * scales[module]
            yield f"{module}.weight", (w.float() + delta.to(w.device)).to(w.dtype)
    if pending:
        raise ValueError(f"LoRA layers without their base weight or adapters: {sorted(pending)}")


def base_weights(
    named: Iterable[tuple[str, torch.Tensor]], scales: dict[str, float]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The frozen base alone under the HF names (what an adapter applies to), adapters left out."""
    for name, tensor in _base_names(named, scales):
        if name.rpartition(".")[2] not in ADAPTER_NAMES:
            yield name, tensor


def _base_names(
    named: Iterable[tuple[str, torch.Tensor]], scales: dict[str, float]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Within an adapted ``<m>``: ``<m>.base_layer.weight`` -> ``<m>.weight``, ``<m>.lora_A.default.weight``
    -> ``<m>.lora_A``; other names as they are."""
    for name, tensor in named:
        match = _PEFT_KEY.match(name)
        if match and match["module"] in scales:
            name = f"{match['module']}.{match['leaf'] or match['factor']}"
        yield name, tensor


def save_adapter(
    path: str | Path,
    model: torch.nn.Module,
    adapters: dict[str, torch.Tensor],
    config: LoraConfig,
    base_model: str,
) -> None:
    """``adapters`` (the adapted model's adapter keys, full tensors) in the folder ``PeftModel.save_pretrained``
    writes: ``adapter_config.json`` naming ``base_model`` and ``adapter_model.safetensors``."""
    from peft import get_peft_model_state_dict
    from peft.utils import SAFETENSORS_WEIGHTS_NAME
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = copy.copy(config)
    config.base_model_name_or_path = base_model
    config.save_pretrained(str(path))
    state = get_peft_model_state_dict(model, state_dict=adapters, adapter_name=ADAPTER)
    state = {PEFT_PREFIX + k: v.detach().cpu().contiguous() for k, v in state.items()}
    save_file(state, str(path / SAFETENSORS_WEIGHTS_NAME), metadata={"format": "pt"})


def load_adapter(path: str | Path, model: torch.nn.Module) -> list[str]:
    """A :func:`save_adapter` folder's adapters into ``model``; returns the adapter keys that do not match
    (``model``'s the folder lacks, the folder's ``model`` lacks)."""
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights

    weights = load_peft_weights(str(path), device="cpu")
    result = set_peft_model_state_dict(model, weights, adapter_name=ADAPTER)
    return [k for k in (*result.missing_keys, *result.unexpected_keys) if is_adapter(k)]


def check_lora_config(lora: Any, backend: str, fsdp: bool = False) -> None:
    """One line naming the ``trainer.lora`` field that cannot work (``lora.rank`` is set)."""
    if fsdp and lora.full_warm_start:
        raise RelaxUserError(
            "trainer.lora.full_warm_start needs the unsharded torch backend (trainer=torch); with trainer=fsdp "
            "set trainer.lora.full_warm_start=false (adapters during the warm-start too)"
        )
    if backend != "torch":
        raise RelaxUserError(
            f"trainer.lora trains adapters with the torch backend (and trainer=fsdp); this run has "
            f"trainer.backend={backend}: use trainer=torch or set trainer.lora.rank=0"
        )
    if lora.rank < 0:
        raise RelaxUserError(f"trainer.lora.rank must be >= 0 (0: off), got {lora.rank}")
    if lora.alpha <= 0:
        raise RelaxUserError(f"trainer.lora.alpha must be > 0, got {lora.alpha}")
    if not 0.0 <= lora.dropout < 1.0:
        raise RelaxUserError(f"trainer.lora.dropout must be in [0, 1), got {lora.dropout}")
    if not lora.target_modules:
        raise RelaxUserError("trainer.lora.target_modules is empty: name the layers to adapt (e.g. q_proj)")


def saved_adapter_name(name: str) -> str:
    """A state-dict adapter key as peft's saved file names it:
    ``<m>.lora_A.default.weight`` -> ``base_model.model.<m>.lora_A.weight``."""
    return PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".")


def adapter_payload(
    named: Iterable[tuple[str, torch.Tensor]], scales: dict[str, float], base_version: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """An adapted model's state dict as an adapter payload (see the module docstring): the base under the HF
    names, the adapters under peft's saved names, then the base version and the scale."""
    values = set(scales.values())
    if len(values) != 1:
        raise ValueError(f"adapter sync needs one alpha / rank for every adapted layer, got {sorted(values)}")
    for name, tensor in named:
        match = _PEFT_KEY.match(name)
        if match and match["module"] in scales:
            if match["factor"]:
                yield saved_adapter_name(name), tensor
            else:
                yield f"{match['module']}.{match['leaf']}", tensor
        else:
            yield name, tensor
    yield BASE_VERSION_KEY, torch.tensor(base_version, dtype=torch.int64)
    yield SCALE_KEY, torch.tensor(values.pop(), dtype=torch.float64)


def is_adapter_payload(state_dict: dict[str, torch.Tensor]) -> bool:
    return BASE_VERSION_KEY in state_dict


def split_payload(
    state_dict: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int, float]:
    """(base weights under the HF names, adapters under peft's saved names, base version, scale)."""
    base, adapters = {}, {}
    for name, tensor in state_dict.items():
        if name in (BASE_VERSION_KEY, SCALE_KEY):
            continue
        (adapters if name.startswith(PEFT_PREFIX) and is_adapter(name) else base)[name] = tensor
    return base, adapters, int(state_dict[BASE_VERSION_KEY]), float(state_dict[SCALE_KEY])


def merged_payload(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The merged weights of an adapter payload (any other state dict as it is), in the base's order: what a
    receiver that cannot apply adapters loads, merged by :func:`merged_weights` as a backend merges its own."""
    if not is_adapter_payload(state_dict):
        return state_dict
    base, adapters, _, scale = split_payload(state_dict)
    scales = dict.fromkeys({n.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0] for n in adapters}, scale)
    # back under the adapted model's names: <m>.base_layer.weight, <m>.lora_A.default.weight
    in_model = {
        f"{n.removeprefix(PEFT_PREFIX).removesuffix('.weight')}.{ADAPTER}.weight": t
        for n, t in adapters.items()
    }
    merged = dict(merged_weights([*peft_names(base, scales).items(), *in_model.items()], scales))
    return {name: merged[name] for name in base}


def adapter_folder(
    path: str | Path, adapters: dict[str, torch.Tensor], scale: float, base_model: str | None = None
) -> int:
    """Write a payload's adapters (peft's saved names) as a folder peft and vLLM load
    (``adapter_config.json`` + ``adapter_model.safetensors``); returns the adapters' bytes."""
    import json

    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rank = next(t.shape[0] for n, t in adapters.items() if ".lora_A." in n)
    modules = sorted(
        {n.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for n in adapters}
    )
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": scale * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": modules,
        "base_model_name_or_path": base_model,
        "task_type": "CAUSAL_LM",
        "use_rslora": False,
        "use_dora": False,
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    tensors = {k: v.detach().contiguous() for k, v in adapters.items()}
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    return adapter_bytes(tensors)


def adapter_bytes(adapters: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in adapters.values())


def check_engine_sync(lora: Any, max_rank: int | None) -> None:
    """One line when ``trainer.lora.engine_sync`` cannot work; ``max_rank``: the largest LoRA rank the rollout
    engine serves (None: it serves no adapters and takes merged weights whatever the setting)."""
    if lora.engine_sync not in ("merged", "adapter"):
        raise RelaxUserError(f"trainer.lora.engine_sync must be merged or adapter, got {lora.engine_sync!r}")
    if lora.engine_sync == "adapter" and max_rank is not None and lora.rank > max_rank:
        raise RelaxUserError(
            f"trainer.lora.engine_sync=adapter: the rollout engine serves LoRA ranks up to {max_rank}, and "
            f"trainer.lora.rank={lora.rank}: set trainer.lora.engine_sync=merged (or a smaller rank)"
        )
