"""GPU-only megatron paths: Transformer Engine layer specs, NCCL, megatron's distributed optimizer.

Skipped without CUDA; the CPU tests cover the same conversion and training logic on local specs.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs CUDA: Transformer Engine specs, NCCL and megatron's distributed optimizer are GPU-only",
    ),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


@pytest.fixture(scope="module")
def world(megatron_world) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_gpu_megatron_forward_matches_hf(world, family: str) -> None:
    from megatron_twins import dense_config, make_hf_model, moe_config, random_ids

    from relax_models.megatron.bridge import Qwen3Bridge
    from relax_models.megatron.model import (
        ParallelSizes,
        arch_from_hf_config,
        build_gpt_model,
        forward_logits,
        initialize_parallel,
        uses_transformer_engine,
    )

    config = dense_config() if family == "dense" else moe_config()
    hf = make_hf_model(config)
    arch = arch_from_hf_config(config)
    sizes = ParallelSizes()
    initialize_parallel(arch, sizes)
    model = build_gpt_model(arch, sizes).eval()
    bridge = Qwen3Bridge(arch, sizes, fused_norms=uses_transformer_engine())
    bridge.load_into(model, hf.state_dict())
    ids = random_ids(2, 16)
    with torch.no_grad():
        expected = hf(ids).logits
        got = forward_logits(model, ids.cuda(), arch.vocab_size).cpu()
    assert (got - expected).abs().max().item() < 1e-3
    gathered = dict(bridge.iter_hf_weights(model))
    assert all(torch.equal(v.cpu(), hf.state_dict()[k]) for k, v in gathered.items() if k in hf.state_dict())


def test_gpu_backend_step_tracks_the_torch_backend(world, tmp_path) -> None:
    from relax_core.backends.megatron_backend import MegatronBackend
    from relax_core.backends.torch_backend import TorchBackend
    from relax_core.config.schema import ModelConfig, TrainerConfig
    from relax_core.samples import Sample, TrainBatch
    from relax_models.tiny import build_tiny_qwen3

    folder = str(build_tiny_qwen3(tmp_path / "m", seed=3, hidden_size=64, num_hidden_layers=2, head_dim=16))
    cfg = TrainerConfig(lr=1e-3, grad_clip=1.0)
    samples = [Sample(i, 0, [5, 6, 7], [8 + i, 9], [0.0, 0.0], [1, 1], reward=float(i)) for i in range(4)]
    batch = TrainBatch.from_samples(samples, pad_token_id=0)

    def loss_fn(micro, logprobs, entropy):
        return -(logprobs * micro.loss_mask).sum() / 8.0, {}

    mega = MegatronBackend(folder, cfg, ModelConfig(), seed=1)
    ref = TorchBackend(folder, cfg, ModelConfig())
    m, r = mega.train_step(batch, loss_fn, 2), ref.train_step(batch, loss_fn, 2)
    assert m["loss"] == pytest.approx(r["loss"], rel=1e-3)
    assert (mega.forward_logprobs(batch) - ref.forward_logprobs(batch)).abs().max().item() < 1e-3


def test_gpu_distributed_optimizer_state_survives_a_checkpoint(world, tmp_path) -> None:
    """Megatron's distributed optimizer (CUDA-only in megatron-core 0.16.1): its sharded Adam moments are
    saved with the checkpoint, so the step after a resume equals the uninterrupted one."""
    from relax_core.backends.megatron_backend import MegatronBackend
    from relax_core.config.schema import ModelConfig, TrainerConfig
    from relax_core.samples import Sample, TrainBatch
    from relax_models.tiny import build_tiny_qwen3

    folder = str(build_tiny_qwen3(tmp_path / "m", seed=3, hidden_size=64, num_hidden_layers=2, head_dim=16))
    cfg = TrainerConfig(lr=1e-3, grad_clip=1.0)
    samples = [Sample(i, 0, [5, 6, 7], [8 + i, 9], [0.0, 0.0], [1, 1], reward=float(i)) for i in range(4)]
    batch = TrainBatch.from_samples(samples, pad_token_id=0)

    def loss_fn(micro, logprobs, entropy):
        return -(logprobs * micro.loss_mask).sum() / 8.0, {}

    mega = MegatronBackend(folder, cfg, ModelConfig(), seed=1)
    mega.train_step(batch, loss_fn, 2)
    mega.save_checkpoint(str(tmp_path / "ckpt"))
    expected = mega.train_step(batch, loss_fn, 2)
    resumed = MegatronBackend(folder, cfg, ModelConfig(), seed=2)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.train_step(batch, loss_fn, 2) == pytest.approx(expected, rel=1e-6)
