"""Low-rank adapters (LoRA) on the linear layers of an HF model: ``y = x Wᵀ + b + s · dropout(x) Aᵀ Bᵀ``
with ``s = alpha / rank``, ``A [rank, in]`` random and ``B [out, rank]`` zero at the start (the model starts as
the base model), W and b frozen.

Our own small wrapper rather than peft: the models are plain ``nn.Linear`` layers, a :class:`LoRALinear`
keeps the base layer's parameter names (``q_proj.weight``), so the HF names and shapes the rollout engines and
checkpoints know stay as they are, and FSDP2 shards it like any other module (no peft wrapper prefixes to
strip, no new dependency).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

from relax_models.errors import RelaxUserError

ADAPTER_NAMES = ("lora_A", "lora_B")


class LoRALinear(torch.nn.Linear):
    """An ``nn.Linear`` (same ``weight``/``bias``, frozen) plus trainable ``lora_A``/``lora_B``."""

    def __init__(self, base: torch.nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # the base layer's parameters, shared
        kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = torch.nn.Parameter(torch.empty(rank, self.in_features, **kw))
        self.lora_B = torch.nn.Parameter(torch.empty(self.out_features, rank, **kw))
        self.scale = alpha / rank
        self.dropout = dropout
        self.reset_adapter()

    def reset_adapter(self) -> None:
        """A as ``nn.Linear`` initialises its weight, B zero: the adapter adds nothing until trained."""
        torch.nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        torch.nn.init.zeros_(self.lora_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # dropout only on the training forward: scoring passes (no grad) see the deterministic policy
        drop = self.dropout if self.training and torch.is_grad_enabled() else 0.0
        low = F.linear(F.linear(F.dropout(x, drop) if drop else x, self.lora_A), self.lora_B)
        return F.linear(x, self.weight, self.bias) + low * self.scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.shape[0]}, scale={self.scale:g}"


def apply_lora(
    model: torch.nn.Module, rank: int, alpha: float, dropout: float, target_modules: list[str]
) -> dict[str, float]:
    """Replace every ``nn.Linear`` whose attribute name is in ``target_modules`` by a :class:`LoRALinear`
    and freeze everything but the adapters. Returns ``{module name: scale}`` of the adapted layers."""
    targets = set(target_modules)
    found = [
        (name, module)
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in targets
        and isinstance(module, torch.nn.Linear)
        and not isinstance(module, LoRALinear)
    ]
    if not found:
        raise RelaxUserError(
            f"trainer.lora.target_modules={sorted(targets)} matches no linear layer of the model; "
            "name the model's projection layers (e.g. q_proj, v_proj)"
        )
    model.requires_grad_(False)
    for name, module in found:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, LoRALinear(module, rank, alpha, dropout))
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.lora_A.requires_grad_(True)
            module.lora_B.requires_grad_(True)
    return {name: alpha / rank for name, _ in found}


def is_adapter(name: str) -> bool:
    """Whether a state-dict key names an adapter factor."""
    return name.rsplit(".", 1)[-1] in ADAPTER_NAMES


def merged_weights(
    named: Iterable[tuple[str, torch.Tensor]], scales: dict[str, float]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's state dict from a LoRA model's, in its order: each adapted ``<m>.weight`` becomes
    ``W + scale · B A`` (computed in fp32), the adapter keys disappear. Streams: a base weight waits only for
    its own ``lora_A``/``lora_B``, which follow it in a module's state dict."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
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


def check_lora_config(lora, backend: str, fsdp: bool = False) -> None:
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
