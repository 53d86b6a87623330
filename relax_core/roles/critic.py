"""Critic role (PPO): a scalar value head on a copy of the policy architecture, trained on GAE returns."""

from __future__ import annotations

from pathlib import Path

import torch

from relax_core.algorithms.advantages import gae, last_token_rewards
from relax_core.algorithms.logprobs import response_positions
from relax_core.algorithms.value import clipped_value_loss
from relax_core.backends.base import batch_to_device
from relax_core.databus import DataBus, partition_name, sample_key
from relax_core.databus.records import SAMPLE_FIELDS, batch_from_rows
from relax_core.databus.stages import score_stage
from relax_core.placement import role_device
from relax_core.roles import use_threads
from relax_core.samples import TrainBatch
from relax_models.loader import load_causal_lm, load_tokenizer


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
        self.head = torch.nn.Linear(self.trunk.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.head.to(device)

    def forward(self, batch: TrainBatch) -> torch.Tensor:
        """Values ``[B, R]`` on the CPU, next to the batch's masks and returns."""
        batch = batch_to_device(batch, self.head.weight.device)
        hidden = self.trunk.base_model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask
        ).last_hidden_state
        values = self.head(hidden).squeeze(-1).float()  # [B, L]
        return (values.gather(1, response_positions(batch)) * batch.loss_mask).cpu()


class Critic:
    def __init__(self, cfg, model_path: str, bus: DataBus | None = None) -> None:
        use_threads(cfg.trainer.num_threads)
        self.bus = bus
        self.pad = load_tokenizer(model_path).pad_token_id if bus is not None else 0
        torch.manual_seed(cfg.seed + 17)
        if cfg.algorithm.critic is None:
            raise ValueError("the Critic role needs algorithm.critic")
        self.cfg = cfg.algorithm.critic
        self.gamma, self.lam = cfg.algorithm.gamma, cfg.algorithm.lam
        self.model = ValueModel(
            self.cfg.model_path or model_path, cfg.model.dtype, cfg.model.attn_implementation, role_device()
        )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr)

    @torch.no_grad()
    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """V ``[B, R]`` for every response token (0 at masked tokens)."""
        self.model.eval()
        parts = [self.model(mb) for mb in batch.micro_batches(self.cfg.micro_batch_size)]
        width = batch.loss_mask.shape[1]
        return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])

    def process(self, step: int, total: int) -> dict[str, float]:
        """mode=async: write ``values`` for every row of step N, then fit them on the whole step (the values
        of step N+1 therefore come from the critic trained on step N, as in colocate)."""
        metrics = score_stage(
            self.bus,
            self.pad,
            step,
            total,
            "critic",
            "values",
            self.cfg.micro_batch_size,
            self.compute_values,
        )
        keys = [sample_key(i) for i in range(total)]
        rows = self.bus.get(partition_name(step), keys, SAMPLE_FIELDS + ["values"])
        return metrics | self.fit(batch_from_rows(rows, self.pad, ["values"]))

    def fit(self, batch: TrainBatch) -> dict[str, float]:
        """Regress on the GAE returns R_t = A_t + V_t of ``batch`` (rewards and ``extras['values']``)."""
        values, mask = batch.extras["values"], batch.loss_mask
        _, batch.extras["returns"] = gae(
            last_token_rewards(batch.rewards, mask), values, mask, self.gamma, self.lam
        )
        metrics = self.train(batch)
        metrics["critic/values_mean"] = float((values * mask).sum() / mask.sum().clamp_min(1))
        return metrics

    def train(self, batch: TrainBatch) -> dict[str, float]:
        """``critic.epochs`` optimizer steps on the clipped value loss against ``extras['returns']``.

        ``extras['values']`` are the values the advantages were computed with (V_old of the clip).
        """
        self.model.train()
        total_tokens = max(float(batch.loss_mask.sum()), 1.0)
        sums: dict[str, float] = {}
        for _ in range(self.cfg.epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for micro in batch.micro_batches(self.cfg.micro_batch_size):
                values = self.model(micro)
                loss, metrics = clipped_value_loss(
                    values,
                    micro.extras["values"],
                    micro.extras["returns"],
                    micro.loss_mask,
                    self.cfg.value_clip,
                )
                share = float(micro.loss_mask.sum()) / total_tokens
                (loss * share).backward()
                sums["critic/vf_loss"] = sums.get("critic/vf_loss", 0.0) + float(loss.detach()) * share
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + float(v) * share
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            self.optimizer.step()
            sums["critic/grad_norm"] = sums.get("critic/grad_norm", 0.0) + float(grad_norm)
        return {k: v / self.cfg.epochs for k, v in sums.items()}

    def save_checkpoint(self, path: str) -> None:
        """Value model and optimizer (the Adam moments matter: a resumed critic must not re-warm)."""
        Path(path).mkdir(parents=True, exist_ok=True)
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        torch.save(state, Path(path) / "critic.pt")

    def load_checkpoint(self, path: str) -> None:
        state = torch.load(Path(path) / "critic.pt", weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def load_trunk(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Start the value trunk from the policy's weights (after the supervised warm-start)."""
        self.model.trunk.load_state_dict(state_dict, strict=False)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
