"""The rollout-engine interface every generation backend implements (torch, SGLang, vLLM).

An engine turns token ids into sampled continuations with the log-probability of every sampled token
under the temperature-scaled distribution before top-p/top-k truncation (what training recomputes),
swaps weights between steps, and can be paused, resumed and aborted around a weight swap.
"""

from __future__ import annotations

import abc
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from relax_core.errors import RelaxUserError
from relax_core.weight_transfer.disk import read_weights_folder

if TYPE_CHECKING:
    from relax_core.config.schema import ModelConfig, RolloutConfig


@dataclass
class EngineSetup:
    """What building a rollout engine takes; each engine reads the part it needs (``from_config``)."""

    model_path: str
    seed: int
    rollout: RolloutConfig | None = None  # None: the defaults of conf/rollout
    model: ModelConfig | None = None  # the policy's dtype and attention (the torch engine loads it itself)
    tokenizer: Any = None  # the policy's; the torch engine stops on its eos and pads with its pad token
    record_routing: bool = False  # algorithm.routing_replay: results carry MoE routing (torch engine)
    # the policy's LoRA rank when its versions arrive as adapter payloads (relax_models.lora); 0: merged weights
    lora_rank: int = 0

    def rollout_config(self) -> RolloutConfig:
        from relax_core.config.schema import RolloutConfig

        return self.rollout if self.rollout is not None else RolloutConfig()


@dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)
    # EOS does not end a row: fixed-length generation (benchmarks, tests), as SGLang and vLLM offer
    ignore_eos: bool = False
    # samples per request sharing one prefill
    n: int = 1
    # sampled evaluation: the torch engine draws from a stream seeded with this, and its training stream
    # continues afterwards where it was (relax_core/roles/rollout.py); null: the engine's own stream
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class GenerationRequest:
    input_ids: list[int]
    request_id: str = ""
    multimodal_inputs: dict[str, Any] | None = None


@dataclass
class GenerationResult:
    output_ids: list[int]
    logprobs: list[float]
    # "stop" (EOS / stop token / stop string), "length" (budget), "abort"
    finish_reason: str
    request_id: str = ""
    weight_version: int = 0
    # the torch engine with algorithm.routing_replay: MoE expert indices [prompt + fed response tokens,
    # layers, top_k] (relax_models.routing_replay.record_routing); None otherwise
    routing: torch.Tensor | None = None


class RolloutEngine(abc.ABC):
    """Generates continuations; ``generate`` returns ``n`` results per request, request-major."""

    weight_version: int = 0
    # the largest LoRA rank the engine serves itself, taking a LoRA policy's versions as adapter payloads
    # (relax_models.lora.adapter_payload: the base only when it changed, then the adapters); None: it takes
    # merged weights only (the Rollout merges a payload for it)
    max_lora_rank: ClassVar[int | None] = None
    # whether weight updates cross into another process (an engine server); such an engine fills sync_stats,
    # what its newest update moved: weight_sync/bytes, weight_sync/seconds, weight_sync/adapter_only
    copies_weights: ClassVar[bool] = False
    sync_stats: dict[str, float] = {}  # noqa: RUF012 (replaced, never mutated)

    @classmethod
    def check_media(cls, media: list[str], rollout: RolloutConfig, modality: str) -> None:
        """Refuses, in one line, a run whose prompts carry ``media`` kinds this engine would never see (the
        launcher and the memory doctor ask before anything starts). The base: token ids only."""
        if media:
            raise RelaxUserError(
                f"rollout={rollout.engine} cannot take {'/'.join(media)} inputs yet (its HTTP client sends token "
                f"ids only, so the engine would never see the media of modality={modality}): use rollout=torch"
            )

    @abc.abstractmethod
    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[GenerationResult]:
        """Sample ``sampling.n`` continuations of every request."""

    @abc.abstractmethod
    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load new policy weights (HF parameter names) and tag later results with ``version``."""

    def update_weights_from_disk(self, path: str, version: int) -> None:
        """Load weights from the ``*.safetensors`` files of an HF folder (SGLang's disk update)."""
        self.update_weights(read_weights_folder(path), version)

    def pause(self) -> None:
        """Stop admitting new work (in-flight work finishes or is aborted per the engine)."""

    def resume(self) -> None:
        """Admit work again after :meth:`pause`."""

    def abort(self, request_ids: Collection[str] | None = None) -> None:
        """Cut in-flight generations short (all, or those of ``request_ids``); they return with
        ``finish_reason="abort"`` and the tokens generated so far."""

    def release_memory(self) -> None:
        """Free the memory generation holds between calls (KV cache, decode buffers) so that a trainer beside
        the engine can use it; weights stay usable. Called while idle (colocate: after the rollout)."""

    def resume_memory(self) -> None:
        """Take back what :meth:`release_memory` freed, before the next weight update or generation (engines
        that re-create it on demand need nothing here)."""

    def health(self) -> bool:
        return True

    def shutdown(self) -> None:
        """Release resources (servers, caches)."""


def engine_dtype(name: str):
    """``rollout.dtype``: float32, bfloat16, float16, or auto (bf16 where the CPU has AVX-512 BF16 / on GPU)."""
    import torch

    if name == "auto":
        if torch.cuda.is_available():
            return torch.bfloat16
        try:
            flags = open("/proc/cpuinfo").read()
        except OSError:
            flags = ""
        return torch.bfloat16 if ("avx512_bf16" in flags or "amx_bf16" in flags) else torch.float32
    from relax_models.loader import DTYPES

    if name not in DTYPES:
        raise RelaxUserError(f"rollout.dtype={name!r} is not one of {sorted(DTYPES) + ['auto']}")
    return DTYPES[name]


# rollout.memory_fraction when null (vLLM and SGLang), on a GPU the engine has to itself: below vLLM's own
# 0.92, because the Rollout's weight-transfer group (NCCL buffers) and the received buckets live beside the
# server's budget
GPU_MEMORY_FRACTION = 0.85


def default_memory_fraction(num_gpus: float) -> float:
    """``rollout.memory_fraction`` when null: :data:`GPU_MEMORY_FRACTION` of the engine's part of its GPU.

    ``rollout.num_gpus`` below 1 is the Ray share of a GPU the engine shares (colocate puts an engine and an
    Actor rank in one bundle), so the engine keeps to that share and leaves the trainer the rest.
    """
    return round(GPU_MEMORY_FRACTION * (num_gpus if 0.0 < num_gpus < 1.0 else 1.0), 4)
