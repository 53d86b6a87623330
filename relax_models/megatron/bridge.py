"""HF <-> Megatron weight bridge for the Qwen3 families (dense, MoE, and shared-expert MoE).

HF side: the parameter names of the safetensors files that transformers writes for
``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` (one tensor per expert:
``model.layers.{l}.mlp.experts.{e}.gate_proj.weight``). transformers 5 keeps experts *fused* in memory
(``mlp.experts.gate_up_proj`` ``[E, 2I, H]``); ``relax_models.expert_names`` translates.

Megatron side: the local parameter names of one rank's ``GPTModel`` shard. Every megatron parameter has a
:class:`Rule` saying which HF tensors it is made of and how it is split across ranks:

* ``qkv``: q/k/v stacked per query group, ``[q_0 .. q_{n/g-1}, k, v]`` for each of the ``g`` KV groups,
  then split along rows over tensor-parallel ranks (megatron's interleaved layout);
* ``glu``: ``linear_fc1 = [gate; up]`` *per rank*, i.e. rank r holds ``[gate_r; up_r]``;
* ``vocab``: zero-padded to the padded vocab size, then split along rows;
* ``row``: split along columns; ``rep``: replicated.

Expert weights are split over the expert-tensor-parallel group and distributed over expert-parallel
ranks (rank ``p`` holds experts ``p*E/EP .. (p+1)*E/EP - 1``); layers over pipeline stages likewise.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

# the fused <-> per-expert naming lives in relax_models.expert_names (the vLLM client needs it too)
from relax_models.expert_names import fuse_experts, unfuse_experts  # noqa: F401
from relax_models.megatron.model import ArchSpec, ParallelSizes
from relax_models.weight_buckets import bucket_by_bytes  # noqa: F401  (re-exported for the megatron backend)

HFStateDict = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class Ranks:
    """This process's coordinates in each megatron parallel group."""

    tp: int = 0
    pp: int = 0
    ep: int = 0
    etp: int = 0

    @classmethod
    def from_parallel_state(cls) -> Ranks:
        from megatron.core import parallel_state as ps

        return cls(
            tp=ps.get_tensor_model_parallel_rank(),
            pp=ps.get_pipeline_model_parallel_rank(),
            ep=ps.get_expert_model_parallel_rank(),
            etp=ps.get_expert_tensor_parallel_rank(),
        )


@dataclass(frozen=True)
class Rule:
    """How one megatron parameter is built from HF tensors and split across ranks."""

    hf_names: tuple[str, ...]
    kind: str  # "rep" | "row" | "vocab" | "qkv" | "glu"
    group: str = "tp"  # "tp" (dense/attention) or "etp" (routed experts)


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
# TE specs fuse the pre-attention/pre-MLP RMSNorm into the following linear ("layer_norm_weight").
_LAYER_RULES: dict[str, tuple[tuple[str, ...], str]] = {
    "input_layernorm.weight": (("input_layernorm.weight",), "rep"),
    "self_attention.linear_qkv.layer_norm_weight": (("input_layernorm.weight",), "rep"),
    "self_attention.linear_qkv.weight": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "qkv",
    ),
    "self_attention.linear_qkv.bias": (
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        "qkv",
    ),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), "rep"),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), "rep"),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), "row"),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), "rep"),
    "mlp.linear_fc1.layer_norm_weight": (("post_attention_layernorm.weight",), "rep"),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "glu"),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), "row"),
    "mlp.router.weight": (("mlp.gate.weight",), "rep"),
    "mlp.shared_experts.gate_weight": (("mlp.shared_expert_gate.weight",), "rep"),
    "mlp.shared_experts.linear_fc1.weight": (
        ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
        "glu",
    ),
    "mlp.shared_experts.linear_fc2.weight": (("mlp.shared_expert.down_proj.weight",), "row"),
}


class Qwen3Bridge:
    """Converts between HF checkpoint tensors and one rank's megatron ``GPTModel`` parameters."""

    def __init__(
        self,
        arch: ArchSpec,
        sizes: ParallelSizes | None = None,
        vocab_divisible_by: int = 1,
        fused_norms: bool = False,
    ):
        """``fused_norms``: the model uses Transformer Engine specs, whose dense layers hold the pre-attention
        and pre-MLP RMSNorm gains inside ``linear_qkv`` / ``linear_fc1`` (``layer_norm_weight``)."""
        self.arch = arch
        self.fused_norms = fused_norms
        self.sizes = sizes or ParallelSizes()
        self.padded_vocab = arch.padded_vocab_size(self.sizes.tensor, vocab_divisible_by)
        self.layers_per_stage = arch.num_layers // self.sizes.pipeline
        self.experts_per_rank = arch.num_experts // self.sizes.expert if arch.is_moe else 0

    # ------------------------------------------------------------------ naming
    def rule(self, name: str, ranks: Ranks = Ranks()) -> Rule:
        """The rule for local megatron parameter ``name`` on the rank at ``ranks``."""
        if name == "embedding.word_embeddings.weight":
            return Rule(("model.embed_tokens.weight",), "vocab")
        if name == "output_layer.weight":
            src = "model.embed_tokens.weight" if self.arch.tie_word_embeddings else "lm_head.weight"
            return Rule((src,), "vocab")
        if name == "decoder.final_layernorm.weight":
            return Rule(("model.norm.weight",), "rep")
        m = _LAYER.match(name)
        if m is None:
            raise KeyError(f"no HF counterpart for megatron parameter {name!r}")
        layer = ranks.pp * self.layers_per_stage + int(m.group(1))
        prefix, rest = f"model.layers.{layer}.", m.group(2)
        e = _EXPERT.match(rest)
        if e is not None:
            expert = ranks.ep * self.experts_per_rank + int(e.group(1))
            base = f"{prefix}mlp.experts.{expert}."
            if e.group(2) == "linear_fc1":
                return Rule((base + "gate_proj.weight", base + "up_proj.weight"), "glu", "etp")
            return Rule((base + "down_proj.weight",), "row", "etp")
        if rest not in _LAYER_RULES:
            raise KeyError(f"no HF counterpart for megatron parameter {name!r}")
        hf, kind = _LAYER_RULES[rest]
        return Rule(tuple(prefix + h for h in hf), kind)

    def megatron_names(self, ranks: Ranks = Ranks()) -> list[str]:
        """Parameter names of the ``GPTModel`` shard at ``ranks`` (no ``_extra_state``), in the order
        every rank of a group iterates them."""
        arch, pp = self.arch, self.sizes.pipeline
        names: list[str] = []
        if ranks.pp == 0:
            names.append("embedding.word_embeddings.weight")
        for i in range(self.layers_per_stage):
            g = ranks.pp * self.layers_per_stage + i
            p = f"decoder.layers.{i}."
            moe_layer = arch.is_moe_layer(g)
            if self.fused_norms:
                names.append(p + "self_attention.linear_qkv.layer_norm_weight")
            else:
                names.append(p + "input_layernorm.weight")
            names.append(p + "self_attention.linear_qkv.weight")
            if arch.qkv_bias:
                names.append(p + "self_attention.linear_qkv.bias")
            if arch.qk_norm:
                names += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
            names.append(p + "self_attention.linear_proj.weight")
            if self.fused_norms and not moe_layer:
                names.append(p + "mlp.linear_fc1.layer_norm_weight")
            else:
                names.append(p + "pre_mlp_layernorm.weight")
            if moe_layer:
                names.append(p + "mlp.router.weight")
                for j in range(self.experts_per_rank):
                    names += [
                        p + f"mlp.experts.local_experts.{j}.linear_fc1.weight",
                        p + f"mlp.experts.local_experts.{j}.linear_fc2.weight",
                    ]
                if arch.shared_expert_intermediate_size:
                    names += [
                        p + "mlp.shared_experts.gate_weight",
                        p + "mlp.shared_experts.linear_fc1.weight",
                        p + "mlp.shared_experts.linear_fc2.weight",
                    ]
            else:
                names += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
        if ranks.pp == pp - 1:
            names.append("decoder.final_layernorm.weight")
            if not arch.tie_word_embeddings or pp > 1:
                names.append("output_layer.weight")
        return names

    def hf_names(self) -> list[str]:
        """Every HF checkpoint tensor name of the model (the tied ``lm_head`` is not one)."""
        names: list[str] = []
        seen: set[str] = set()
        for pp in range(self.sizes.pipeline):
            for ep in range(self.sizes.expert):
                for name in self.megatron_names(Ranks(pp=pp, ep=ep)):
                    for h in self.rule(name, Ranks(pp=pp, ep=ep)).hf_names:
                        if h not in seen:
                            seen.add(h)
                            names.append(h)
        return names

    # ------------------------------------------------------------------ HF -> megatron
    def shard_from_hf(self, name: str, hf: HFStateDict, ranks: Ranks = Ranks()) -> torch.Tensor:
        """This rank's value of megatron parameter ``name``, built from HF tensors."""
        rule = self.rule(name, ranks)
        size = self.sizes.etp if rule.group == "etp" else self.sizes.tensor
        rank = ranks.etp if rule.group == "etp" else ranks.tp
        src = [hf[h] for h in rule.hf_names]
        if rule.kind == "rep":
            return src[0].clone()
        if rule.kind == "row":
            return src[0].chunk(size, dim=1)[rank].clone()
        if rule.kind == "vocab":
            w = src[0]
            padded = w.new_zeros((self.padded_vocab, *w.shape[1:]))
            padded[: w.shape[0]] = w
            return padded.chunk(size, dim=0)[rank].clone()
        if rule.kind == "glu":
            gate, up = src
            return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
        if rule.kind == "qkv":
            return self._fuse_qkv(*src).chunk(size, dim=0)[rank].clone()
        raise AssertionError(rule.kind)

    def hf_to_megatron(self, hf: HFStateDict, ranks: Ranks = Ranks()) -> dict[str, torch.Tensor]:
        """The whole local megatron state (parameters only) of the rank at ``ranks``."""
        hf = unfuse_experts(hf)
        return {n: self.shard_from_hf(n, hf, ranks) for n in self.megatron_names(ranks)}

    @torch.no_grad()
    def load_into(self, model: torch.nn.Module, hf: HFStateDict, ranks: Ranks | None = None) -> None:
        """Copy HF weights into a built megatron model in place (dtype/device of the model are kept)."""
        ranks = ranks if ranks is not None else Ranks.from_parallel_state()
        hf = unfuse_experts(hf)
        params = dict(model.named_parameters())
        expected = set(self.megatron_names(ranks))
        unknown = set(params) - expected
        if unknown:
            raise KeyError(f"megatron parameters with no HF source: {sorted(unknown)[:5]}")
        for name, param in params.items():
            value = self.shard_from_hf(name, hf, ranks)
            if value.shape != param.shape:
                raise ValueError(
                    f"{name}: converted shape {tuple(value.shape)} != model {tuple(param.shape)}"
                )
            param.copy_(value)

    def _fuse_qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        a = self.arch
        g, d = a.num_kv_heads, a.head_dim
        tail = q.shape[1:]
        q = q.reshape(g, a.num_heads // g * d, *tail)
        k = k.reshape(g, d, *tail)
        v = v.reshape(g, d, *tail)
        return torch.cat([q, k, v], dim=1).reshape(-1, *tail)

    # ------------------------------------------------------------------ megatron -> HF
    def hf_from_shards(
        self, name: str, shards: list[torch.Tensor], ranks: Ranks = Ranks()
    ) -> dict[str, torch.Tensor]:
        """HF tensors of megatron parameter ``name`` from its shards over its TP (or expert-TP) group,
        in rank order (one element for replicated parameters)."""
        rule = self.rule(name, ranks)
        if rule.kind == "rep":
            full = shards[0]
        elif rule.kind == "row":
            full = torch.cat(shards, dim=1)
        elif rule.kind in ("vocab", "qkv"):
            full = torch.cat(shards, dim=0)
        elif rule.kind == "glu":
            halves = [s.chunk(2, dim=0) for s in shards]
            gate = torch.cat([h[0] for h in halves], dim=0)
            up = torch.cat([h[1] for h in halves], dim=0)
            return dict(zip(rule.hf_names, (gate, up), strict=True))
        else:
            raise AssertionError(rule.kind)
        if rule.kind == "vocab":
            return {rule.hf_names[0]: full[: self.arch.vocab_size]}
        if rule.kind == "qkv":
            return dict(zip(rule.hf_names, self._split_qkv(full), strict=True))
        return {rule.hf_names[0]: full}

    def _split_qkv(self, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = self.arch
        g, d = a.num_kv_heads, a.head_dim
        tail = fused.shape[1:]
        per_group = fused.reshape(g, -1, *tail)
        q, k, v = per_group.split([a.num_heads // g * d, d, d], dim=1)
        return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)

    def is_sharded(self, name: str, ranks: Ranks = Ranks()) -> bool:
        """Whether ``name`` differs across its TP/expert-TP group (and must be gathered)."""
        rule = self.rule(name, ranks)
        size = self.sizes.etp if rule.group == "etp" else self.sizes.tensor
        return rule.kind != "rep" and size > 1

    def megatron_to_hf(
        self, shards_by_tp: list[Mapping[str, torch.Tensor]], ranks: Ranks = Ranks()
    ) -> dict[str, torch.Tensor]:
        """HF state from the local states of every TP rank of one (pipeline, expert) coordinate.

        ``shards_by_tp[r]`` is the state of TP rank r (its expert-TP rank must equal r, or expert-TP be 1).
        The tied ``lm_head`` is left out, as in HF checkpoints.
        """
        out: dict[str, torch.Tensor] = {}
        for name in self.megatron_names(ranks):
            rule = self.rule(name, ranks)
            size = self.sizes.etp if rule.group == "etp" else self.sizes.tensor
            shards = [shards_by_tp[r][name] for r in range(size)]
            if name == "output_layer.weight" and self.arch.tie_word_embeddings:
                continue
            out.update(self.hf_from_shards(name, shards, ranks))
        return out

    # ------------------------------------------------------------------ live model -> HF stream
    @torch.no_grad()
    def iter_hf_weights(
        self, model: torch.nn.Module, ranks: Ranks | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF tensors of a live (possibly sharded) model, one at a time.

        Collective: every rank of the model's TP, expert-TP and expert-parallel groups must iterate in step.
        Tensor-parallel shards are gathered; with expert parallelism the experts of all EP ranks are
        gathered too, so every rank of one pipeline stage yields the same full set. With pipeline
        parallelism each stage yields only its own layers (global names).
        """
        import torch.distributed as dist

        ranks = ranks if ranks is not None else Ranks.from_parallel_state()
        params = dict(model.named_parameters())
        for name in self.megatron_names(ranks):
            if name == "output_layer.weight" and self.arch.tie_word_embeddings:
                continue
            tensor = params[name].detach()
            rule = self.rule(name, ranks)
            shards = [tensor]
            if self.is_sharded(name, ranks):
                group, size = self._dist_group(rule.group)
                shards = [torch.empty_like(tensor) for _ in range(size)]
                dist.all_gather(shards, tensor.contiguous(), group=group)
            hf = self.hf_from_shards(name, shards, ranks)
            if rule.group == "etp" and self.sizes.expert > 1:
                yield from self._gather_experts(name, hf, ranks)
            else:
                yield from hf.items()

    def _gather_experts(
        self, name: str, hf: dict[str, torch.Tensor], ranks: Ranks
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """All-gather one local expert's HF tensors over the expert-parallel group (global names)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        group = ps.get_expert_model_parallel_group()
        rules = [
            self.rule(name, Ranks(tp=ranks.tp, pp=ranks.pp, ep=ep, etp=ranks.etp))
            for ep in range(self.sizes.expert)
        ]
        for i, tensor in enumerate(hf.values()):
            gathered = [torch.empty_like(tensor) for _ in range(self.sizes.expert)]
            dist.all_gather(gathered, tensor.contiguous(), group=group)
            for rule, t in zip(rules, gathered, strict=True):
                yield rule.hf_names[i], t

    @staticmethod
    def _dist_group(group: str) -> tuple[object, int]:
        from megatron.core import parallel_state as ps

        if group == "etp":
            return ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_world_size()
        return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()

    def iter_hf_buckets(
        self, model: torch.nn.Module, bucket_bytes: int, ranks: Ranks | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """:meth:`iter_hf_weights` grouped into lists of at most ``bucket_bytes`` (weight sync)."""
        return bucket_by_bytes(self.iter_hf_weights(model, ranks), bucket_bytes)


class SafetensorsCheckpoint(Mapping[str, torch.Tensor]):
    """Lazy read-only view of an HF folder's safetensors shards: a tensor is read when it is asked for,
    so converting a large checkpoint never holds more than the tensors in use."""

    def __init__(self, folder: str | Path):
        from safetensors import safe_open

        folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {folder}")
            weight_map = {}
            for f in files:
                with safe_open(str(f), "pt") as handle:
                    weight_map.update(dict.fromkeys(handle.keys(), f.name))
        self._folder = folder
        self._map = weight_map
        self._open = safe_open

    def __getitem__(self, key: str) -> torch.Tensor:
        with self._open(str(self._folder / self._map[key]), "pt") as handle:
            return handle.get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)


def module_layout(checkpoint: HFStateDict, tie_word_embeddings: bool) -> dict[str, torch.Tensor]:
    """Checkpoint-named tensors renamed to what a transformers-5 module's ``state_dict`` holds: fused
    experts, and ``lm_head.weight`` present (sharing the embedding) when the embeddings are tied."""
    out = fuse_experts(checkpoint)
    if tie_word_embeddings and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out
