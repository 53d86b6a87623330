"""R3, rollout routing replay for the HF Qwen3 MoE families: record which experts the rollout engine routed
each token to, and make the trainer's forward use the same experts.

An MoE router picks its top-k experts by comparing logits; where two are nearly tied, the engine's numerics
(another batch shape, KV cache, dtype path) and the trainer's can pick differently, and the trainer then scores
a token with experts other than those that generated it. Replay hands the trainer the engine's choices: the
routing *weights* are still the trainer's own softmax over its router logits, gathered at the replayed experts
and renormalised as the model does, so the router keeps its gradient.

Covered routers (same top-k softmax semantics; matched by class, the module hierarchy is untouched):
``Qwen3MoeTopKRouter`` (Qwen3-MoE, e.g. Qwen3-30B-A3B), ``Qwen3VLMoeTextTopKRouter`` (Qwen3-VL-MoE's text
model) and ``Qwen3OmniMoeThinkerTextTopKRouter`` (the Qwen3-Omni thinker). Both context managers act through
forward hooks on those modules and remove them on exit: nothing stays patched outside the context.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch

ROUTER_CLASSES = ("Qwen3MoeTopKRouter", "Qwen3VLMoeTextTopKRouter", "Qwen3OmniMoeThinkerTextTopKRouter")


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k routers in layer order (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__ in ROUTER_CLASSES]


def routing_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype holding every expert index plus :func:`not_recorded` (its largest value)."""
    for dtype in (torch.uint8, torch.int16):
        if num_experts < torch.iinfo(dtype).max:
            return dtype
    return torch.int32


def not_recorded(dtype: torch.dtype) -> int:
    """The index value meaning "no recorded routing here: the trainer routes this token itself"."""
    return torch.iinfo(dtype).max


@contextmanager
def record_routing(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Inside the context, every forward of ``model`` appends one ``[tokens, layers, top_k]`` tensor (in
    :func:`routing_dtype`) to the yielded list: the experts each input token was routed to, tokens in the
    order the routers see them (the flattened ``[batch, seq]`` of the forward's input)."""
    routers = moe_routers(model)
    if not routers:
        raise ValueError(f"{type(model).__name__} has no MoE router of {ROUTER_CLASSES}: nothing to record")
    dtype = routing_dtype(routers[0].num_experts)
    layers: list[torch.Tensor | None] = [None] * len(routers)
    calls: list[torch.Tensor] = []

    def hook(layer: int, module: torch.nn.Module, args, output) -> None:
        layers[layer] = output[2].to(dtype)
        if layer == len(routers) - 1:  # the forward's last MoE layer: one tensor for the whole pass
            calls.append(torch.stack(layers, 1))  # type: ignore[arg-type]
            layers[:] = [None] * len(routers)

    handles = [r.register_forward_hook(partial(hook, i)) for i, r in enumerate(routers)]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


class RoutingReplay:
    """Replays ``indices`` (``[tokens, layers, top_k]``, tokens as the routers see them) in every forward
    while its context (:func:`replay_routing`) is open; ``indices = None`` lets the model route itself.

    Set it before each forward and leave it until that forward's backward is done: under gradient
    checkpointing the backward reruns the forward, which must route as the first run did."""

    def __init__(self, routers: list[torch.nn.Module]) -> None:
        self.routers = routers
        self.indices: torch.Tensor | None = None

    def hook(self, layer: int, module: torch.nn.Module, args, output):
        if self.indices is None:
            return None
        logits, _, own = output
        given = self.indices[:, layer].to(own.device)
        if given.shape != own.shape:
            raise ValueError(
                f"replayed routing has {tuple(given.shape)} expert indices for MoE layer {layer}, the forward "
                f"routes {tuple(own.shape)}: the recorded tokens do not match the forward's input"
            )
        # a token without recorded routing (sentinel) keeps the trainer's own top-k
        recorded = (given != not_recorded(given.dtype)).all(-1, keepdim=True)
        experts = torch.where(recorded, given.long(), own)
        weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, experts)
        if getattr(module, "norm_topk_prob", True):  # the VL router always renormalises and has no flag
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights.to(logits.dtype), experts


@contextmanager
def replay_routing(model: torch.nn.Module) -> Iterator[RoutingReplay]:
    """Hooks ``model``'s routers for the context; set ``.indices`` on the yielded :class:`RoutingReplay`."""
    routers = moe_routers(model)
    if not routers:
        raise ValueError(f"{type(model).__name__} has no MoE router of {ROUTER_CLASSES}: nothing to replay")
    replay = RoutingReplay(routers)
    handles = [r.register_forward_hook(partial(replay.hook, i)) for i, r in enumerate(routers)]
    try:
        yield replay
    finally:
        for handle in handles:
            handle.remove()
