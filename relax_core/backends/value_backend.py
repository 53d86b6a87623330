"""The Critic's training backend: the policy architecture's trunk plus a scalar value head.

It is a :class:`TorchBackend` (or, sharded over the Critic's ranks, an :class:`FSDPBackend`) whose model is
:class:`ValueModel`, so the Critic trains through the same accumulation, clipping, optimizer, checkpoint and
device code as the policy; its loss function receives per-token values ``V [b, r]`` where a policy's
receives log-probs.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from relax_core.algorithms.logprobs import response_positions
from relax_core.backends.base import batch_to_device
from relax_core.backends.fsdp_backend import FSDPBackend
from relax_core.backends.torch_backend import TorchBackend
from relax_core.samples import TrainBatch
from relax_models.loader import load_causal_lm

if TYPE_CHECKING:
    from relax_core.config.schema import CriticConfig, ModelConfig


class ValueModel(torch.nn.Module):
    """The policy's transformer trunk plus ``Linear(hidden, 1)`` on its last hidden state.

    V_t, the value of the state before response token t, is read at the position whose logit predicts
    token t (``prompt_len + t − 1``), the same position the policy scores that token at.
    """

    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        attn_implementation: str = "sdpa",
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.trunk = load_causal_lm(model_path, dtype, attn_implementation, device=device)
        # values read the last hidden state: no LM head (vocab x hidden, a large share of an untied model's
        # weights, and a tied one would be untied by sharding)
        self.trunk.lm_head = None
        self.head = torch.nn.Linear(self.trunk.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.head.to(device)

    def gradient_checkpointing_enable(self) -> None:
        """``model.gradient_checkpointing`` recomputes the trunk's activations, as the policy's."""
        self.trunk.gradient_checkpointing_enable()

    def forward(self, batch: TrainBatch) -> torch.Tensor:
        """Values ``[B, R]`` on the CPU, next to the batch's masks and returns."""
        batch = batch_to_device(batch, self.head.weight.device)
        hidden = self.trunk.base_model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask
        ).last_hidden_state
        values = self.head(hidden).squeeze(-1).float()  # [B, L]
        return (values.gather(1, response_positions(batch)) * batch.loss_mask).cpu()


class ValueHead:
    """What turns a policy backend into the Critic's: the :class:`ValueModel`, its values as the loss's
    per-token input, and a constant-lr AdamW from ``algorithm.critic``. Mixed in before
    :class:`TorchBackend` (one process) or :class:`FSDPBackend` (sharded over the Critic's ranks)."""

    def __init__(self, model_path: str, critic_cfg: CriticConfig, model_cfg: ModelConfig) -> None:
        """``critic_cfg`` (``algorithm.critic``): AdamW at a constant ``lr`` (defaults otherwise) and
        ``grad_clip``; the trunk comes from ``critic.model_path`` or the policy's ``model_path``."""
        optimizer_cfg = SimpleNamespace(
            lr=critic_cfg.lr,
            weight_decay=0.01,
            betas=(0.9, 0.999),
            grad_clip=critic_cfg.grad_clip,
            lr_decay="constant",
            lr_warmup_steps=0,
            min_lr_ratio=1.0,
            total_steps=1,
            share_prompts=False,  # values come from the value model's own forward
        )
        super().__init__(critic_cfg.model_path or model_path, optimizer_cfg, model_cfg)

    def _build_model(self, model_path: str, model_cfg: ModelConfig, device: torch.device) -> torch.nn.Module:
        return ValueModel(model_path, model_cfg.dtype, model_cfg.attn_implementation, device)

    def _logprobs_entropy(self, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-token output the loss takes: values (a value model has no entropy)."""
        values = self.model(batch)
        return values, torch.zeros_like(values)

    def load_trunk(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Start the value trunk from the policy's weights (after the supervised warm-start)."""
        self.load_state_dict({f"trunk.{name}": tensor for name, tensor in state_dict.items()})


class ValueBackend(ValueHead, TorchBackend):
    """The Critic in one process."""


class ShardedValueBackend(ValueHead, FSDPBackend):
    """The Critic as one rank of a group as large as the Actor's (colocate mode with ``trainer.fsdp``):
    its value model is FSDP-sharded over the group, and every call runs collectively."""
