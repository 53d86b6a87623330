"""Chunked log-probs and entropy equal the plain path in values and gradients (tiny tensors, in-process)."""

from __future__ import annotations

import pytest
import torch

from relax_core.algorithms.logprobs import response_logprobs_and_entropy
from relax_core.samples import Sample, TrainBatch


def varied_batch(seed: int, vocab: int) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, (p, r) in enumerate([(3, 5), (6, 1), (2, 7), (4, 3), (5, 6)]):
        ids = torch.randint(1, vocab, (p + r,), generator=g).tolist()
        samples.append(Sample(i, 0, ids[:p], ids[p:], [0.0] * r, [1] * r))
    return TrainBatch.from_samples(samples, pad_token_id=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_matches_plain_values_and_gradients(temperature: float, dtype: torch.dtype) -> None:
    vocab = 50
    batch = varied_batch(0, vocab)
    b, r = batch.loss_mask.shape
    logits = torch.randn(b, r, vocab, generator=torch.Generator().manual_seed(1)).mul(3).to(dtype)
    weights = torch.randn(2, b, r, generator=torch.Generator().manual_seed(2))
    results = []
    for chunk_bytes in (2**30, 4 * vocab * 3):  # one pass; 3 positions per chunk (not a divisor of b·r)
        leaf = logits.clone().requires_grad_(True)
        lp, ent = response_logprobs_and_entropy(leaf, batch, temperature, chunk_bytes=chunk_bytes)
        ((lp * weights[0]).sum() + (ent * weights[1]).sum()).backward()
        results.append((lp.detach(), ent.detach(), leaf.grad))
    (lp0, ent0, g0), (lp1, ent1, g1) = results
    assert torch.equal(lp0, lp1) and torch.equal(ent0, ent1)  # the forward runs the same ops per chunk
    assert g1.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(g1.float(), g0.float(), atol=tol, rtol=tol)


def test_chunked_backward_keeps_no_full_vocab_fp32_intermediates() -> None:
    """What the chunked path saves for backward is the logits alone (no [N, V] fp32 log-softmax)."""
    vocab = 64
    batch = varied_batch(3, vocab)
    b, r = batch.loss_mask.shape
    leaf = torch.randn(b, r, vocab, dtype=torch.bfloat16, requires_grad=True)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        response_logprobs_and_entropy(leaf, batch, 1.0, chunk_bytes=4 * vocab * 2)
    big = [t for t in saved if t.numel() >= b * r * vocab]
    assert big and all(
        t.dtype == torch.bfloat16 and t.untyped_storage().data_ptr() == leaf.data_ptr() for t in big
    )
