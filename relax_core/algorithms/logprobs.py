"""Response-token log-probs and entropy from model logits — the one place every backend gets them."""

from __future__ import annotations

import torch

from relax_core.samples import TrainBatch


def response_positions(batch: TrainBatch) -> torch.Tensor:
    """Index ``[B, R]`` of the logit that predicts each response token: prompt_len + j − 1."""
    steps = torch.arange(batch.loss_mask.shape[1], device=batch.prompt_lens.device)
    last = batch.input_ids.shape[1] - 2
    return (batch.prompt_lens.unsqueeze(1) + steps - 1).clamp(0, max(last, 0))


def response_tokens(batch: TrainBatch) -> torch.Tensor:
    """The response token ids ``[B, R]`` (pad beyond each row's response; the loss mask hides them)."""
    return batch.input_ids.gather(1, (response_positions(batch) + 1).clamp(max=batch.input_ids.shape[1] - 1))


def token_logprobs_and_entropy(
    logits: torch.Tensor, batch: TrainBatch, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(y_j | x, y_<j) and the entropy H_j of each response step ``[B, R]`` from the model's logits
    ``[B, L, V]`` over ``batch.input_ids``: only the R response positions are normalised (not all L), which
    keeps memory at B·R·V."""
    pos = response_positions(batch)
    picked = logits.gather(1, pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    return response_logprobs_and_entropy(picked, batch, temperature)


# fp32 bytes of [positions, V] intermediates one log-softmax may hold at once: above it the response positions
# are scored in chunks (:class:`_ChunkedLogprobsEntropy`); below it the plain autograd path runs unchanged
CHUNK_BYTES = 16 * 2**20


def response_logprobs_and_entropy(
    response_logits: torch.Tensor,
    batch: TrainBatch,
    temperature: float = 1.0,
    chunk_bytes: int = CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(y_j | x, y_<j) and the entropy H_j = −Σ_v p_v log p_v from ``[B, R, V]`` logits whose column j
    predicts response token j.

    The logits are divided by the rollout temperature so training scores tokens under the distribution they
    were sampled from. When the fp32 ``[B·R, V]`` log-softmax would exceed ``chunk_bytes`` it is computed
    ``chunk_bytes`` at a time, forward and backward, so no fp32 copy of the whole micro-batch's vocabulary
    scores ever exists (same values, gradients equal to float rounding).
    """
    tokens = response_tokens(batch)
    b, r, v = response_logits.shape
    rows = max(1, chunk_bytes // (4 * v))
    if b * r <= rows:
        logprobs, entropy = _logprobs_entropy(response_logits, tokens, temperature)
    else:
        flat = _ChunkedLogprobsEntropy.apply(
            response_logits.reshape(b * r, v), tokens.reshape(-1), temperature, rows
        )
        logprobs, entropy = (t.view(b, r) for t in flat)
    return logprobs * batch.loss_mask, entropy * batch.loss_mask


def _logprobs_entropy(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``tokens`` and entropy over the last dimension of ``logits``, in fp32."""
    z = logits.float()
    if temperature > 0 and temperature != 1.0:
        z = z / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    logprobs = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logprobs, entropy


class _ChunkedLogprobsEntropy(torch.autograd.Function):
    """:func:`_logprobs_entropy` over ``[N, V]`` logits, ``rows`` positions at a time.

    Nothing of size ``[N, V]`` is saved for the backward but the logits themselves (which the caller holds
    anyway); the backward recomputes each chunk's softmax and writes its gradient straight into the one
    ``[N, V]`` gradient the logits need: with z = logits / T, p = softmax(z), H = −Σ p log p,
    ∂ log p_y / ∂z = onehot(y) − p and ∂H / ∂z = −p (log p + H).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, temperature: float, rows: int):
        ctx.save_for_backward(logits, tokens)
        ctx.temperature, ctx.rows = temperature, rows
        parts = [_logprobs_entropy(z, t, temperature) for z, t in zip(logits.split(rows), tokens.split(rows))]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor):
        logits, tokens = ctx.saved_tensors
        t, rows = ctx.temperature, ctx.rows
        scale = 1.0 / t if t > 0 and t != 1.0 else 1.0
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], rows):
            end = start + rows
            z = logits[start:end].float()
            logp = torch.log_softmax(z / t if scale != 1.0 else z, dim=-1)
            del z
            p = logp.exp()
            entropy = -(p * logp).sum(-1, keepdim=True)
            g_lp, g_h = grad_logprobs[start:end].unsqueeze(-1), grad_entropy[start:end].unsqueeze(-1)
            # g_H·(−p (log p + H)) − g_lp·p, in place over log p, then + g_lp at the picked token
            chunk = logp.add_(entropy).mul_(g_h).add_(g_lp).mul_(p).neg_()
            del p
            chunk.scatter_add_(-1, tokens[start:end].unsqueeze(-1), g_lp)
            grad[start:end] = chunk.mul_(scale) if scale != 1.0 else chunk
        return grad, None, None, None
