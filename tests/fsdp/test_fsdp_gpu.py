"""GPU-only training paths: CUDA placement of every model-holding role, bf16 kernels, FSDP2 over NCCL,
the Actor offloaded to the CPU between colocate phases (trainer.offload).

Each test skips on a machine without CUDA (or with fewer GPUs than it needs) and says why; the CPU tests
in this folder cover the same logic over gloo in fp32.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from relax_core.config.schema import ModelConfig, TrainerConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: device placement and bf16 kernels"),
]


def test_role_device_is_the_gpu_ray_assigned() -> None:
    from relax_core.runtime.placement import role_device

    assert role_device() == torch.device("cuda", 0)


def test_backend_engine_and_critic_models_live_on_the_gpu_in_bf16(tiny_model_dir: Path) -> None:
    from relax_core.backends.torch_backend import TorchBackend
    from relax_core.backends.value_backend import ValueModel
    from relax_core.engines import build_engine
    from relax_models.loader import load_tokenizer

    model_cfg = ModelConfig(dtype="bfloat16")
    backend = TorchBackend(str(tiny_model_dir), TrainerConfig(), model_cfg)
    # a trainable model keeps fp32 master weights and computes in bf16; a frozen one holds bf16
    assert {(p.device.type, p.dtype) for p in backend.model.parameters()} == {("cuda", torch.float32)}
    frozen = TorchBackend(str(tiny_model_dir), TrainerConfig(), model_cfg, trainable=False)
    assert {(p.device.type, p.dtype) for p in frozen.model.parameters()} == {("cuda", torch.bfloat16)}
    engine = build_engine(
        "torch", str(tiny_model_dir), load_tokenizer(str(tiny_model_dir)), model_cfg, seed=0
    )
    assert engine.device.type == "cuda"
    critic = ValueModel(str(tiny_model_dir), "bfloat16", device=torch.device("cuda", 0))
    assert {p.device.type for p in critic.parameters()} == {"cuda"}


def test_bf16_train_step_on_the_gpu_returns_cpu_logprobs(tiny_model_dir: Path) -> None:
    from relax_core.backends.torch_backend import TorchBackend
    from relax_core.samples import Sample, TrainBatch

    backend = TorchBackend(
        str(tiny_model_dir), TrainerConfig(lr_decay="constant"), ModelConfig(dtype="bfloat16")
    )
    samples = [Sample(i, 0, [5, 6, 7], [8, 9], [0.0, 0.0], [1, 1], reward=float(i)) for i in range(4)]
    batch = TrainBatch.from_samples(samples, 0)
    batch.extras["advantages"] = torch.ones_like(batch.loss_mask)
    assert backend.forward_logprobs(batch).device.type == "cpu"

    def loss_fn(micro, logprobs, entropy):
        return -(logprobs * micro.loss_mask).sum() / batch.loss_mask.sum(), {}

    assert torch.isfinite(torch.tensor(backend.train_step(batch, loss_fn, 2)["loss"]))


def _nccl_worker(rank: int, port: int, model_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ["LOCAL_RANK"] = str(rank)
    import torch.distributed as dist

    from relax_core.backends.fsdp_backend import FSDPBackend

    backend = FSDPBackend(model_dir, TrainerConfig(fsdp=True, dp_size=2), ModelConfig(dtype="bfloat16"))
    assert dist.get_backend() == "nccl" and backend.device.type == "cuda"
    assert {p.to_local().device.type for p in backend.model.parameters()} == {"cuda"}
    backend.offload()  # trainer.offload: the shards leave the GPU and come back
    assert {p.to_local().device.type for p in backend.model.parameters()} == {"cpu"}
    backend.onload()
    assert {p.to_local().device.type for p in backend.model.parameters()} == {"cuda"}
    assert len(backend.state_dict()) > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: FSDP2 over NCCL")
def test_fsdp_two_ranks_over_nccl(tiny_model_dir: Path) -> None:
    import torch.multiprocessing as mp

    from relax_models.megatron.cpu_shim import free_port

    mp.start_processes(_nccl_worker, args=(free_port(), str(tiny_model_dir)), nprocs=2, start_method="spawn")


def test_offload_frees_the_gpu_between_phases_and_training_continues_unchanged(tiny_model_dir: Path) -> None:
    """trainer.offload: after a step, offload() leaves no parameter, gradient or Adam moment on the GPU;
    onload() brings them back and the next step equals the one of a backend that never offloaded."""
    from relax_core.backends.torch_backend import TorchBackend
    from relax_core.samples import Sample, TrainBatch

    samples = [Sample(i, 0, [5, 6, 7], [8, 9], [0.0, 0.0], [1, 1], reward=float(i)) for i in range(4)]
    batch = TrainBatch.from_samples(samples, 0)

    def loss_fn(micro, logprobs, entropy):
        return -(logprobs * micro.loss_mask).sum() / batch.loss_mask.sum(), {}

    trainer = TrainerConfig(lr_decay="constant")
    torch.manual_seed(0)
    offloaded = TorchBackend(str(tiny_model_dir), trainer, ModelConfig())
    torch.manual_seed(0)
    resident = TorchBackend(str(tiny_model_dir), trainer, ModelConfig())
    for backend in (offloaded, resident):
        backend.train_step(batch, loss_fn, 2)
    offloaded.offload()
    moments = [v for s in offloaded.optimizer.state.values() for v in s.values() if v.dim() > 0]
    assert {p.device.type for p in offloaded.model.parameters()} == {"cpu"}
    assert {v.device.type for v in moments} == {"cpu"} and moments
    assert all(p.grad is None for p in offloaded.model.parameters())
    offloaded.onload()
    assert {p.device.type for p in offloaded.model.parameters()} == {"cuda"}
    # same kernels on the same inputs; approx only for CUDA's non-deterministic reductions
    assert offloaded.train_step(batch, loss_fn, 2) == pytest.approx(resident.train_step(batch, loss_fn, 2))
    want = resident.state_dict()
    for name, tensor in offloaded.state_dict().items():
        torch.testing.assert_close(tensor, want[name], msg=name)
