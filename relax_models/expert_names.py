"""Routed-expert weight names: transformers 5 keeps a MoE layer's experts *fused* in memory
(``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``), while checkpoints, the
Megatron bridge and vLLM's loader name one tensor per expert (``mlp.experts.{e}.gate_proj.weight``).

Torch only, so every consumer (the Megatron bridge, the vLLM engine client) can import it cheaply.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

_FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def unfuse_experts(hf: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """Per-expert checkpoint names from transformers-5 in-memory fused experts (no-op if none are fused).

    ``experts.gate_up_proj [E, 2I, H]`` -> ``experts.{e}.gate_proj/up_proj.weight [I, H]``;
    ``experts.down_proj [E, H, I]`` -> ``experts.{e}.down_proj.weight``. The results are views (no copy).
    """
    if not any(_FUSED_EXPERTS.match(k) for k in hf):
        return hf
    out: dict[str, torch.Tensor] = {}
    for key, value in hf.items():
        m = _FUSED_EXPERTS.match(key)
        if m is None:
            out[key] = value
            continue
        for e in range(value.shape[0]):
            if m.group(2) == "gate_up_proj":
                gate, up = value[e].chunk(2, dim=0)
                out[f"{m.group(1)}.{e}.gate_proj.weight"] = gate
                out[f"{m.group(1)}.{e}.up_proj.weight"] = up
            else:
                out[f"{m.group(1)}.{e}.down_proj.weight"] = value[e]
    return out


def fuse_experts(hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`unfuse_experts`: the names a transformers-5 MoE module's ``state_dict`` uses."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for key, value in hf.items():
        m = _PER_EXPERT.match(key)
        if m is None:
            out[key] = value
        else:
            experts.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = value
    for prefix, parts in experts.items():
        n = len(parts["down_proj"])
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts["gate_proj"][e], parts["up_proj"][e]], dim=0) for e in range(n)]
        )
        out[f"{prefix}.down_proj"] = torch.stack([parts["down_proj"][e] for e in range(n)])
    return out
