"""Every collective of the sharded training and scoring paths, on a group that serves an accelerator only.

On a GPU node the FSDP ranks' default group is NCCL, which takes CUDA tensors only: a metric reduced or a
log-prob gathered on the CPU fails there ("No backend type associated with device type cpu") although
gloo takes it on a CPU-only machine. Here two ranks run the real backends on the *twin* device
(``tests/twin``: torch's PrivateUse1 device computing with the CPU's kernels on host memory), and the
default group's only backend serves that device, so a CPU tensor in any collective fails as under NCCL.
The ranks run the FSDP Actor backend (log-probs, two optimizer steps with metric reduction, the streamed
step's rank sums, gathered weights, checkpoint save and exact resume), the sharded Reference, the sharded
Critic, the Actor's staleness gather, and the helpers the megatron backend reduces with; each call site
reports its own error, and the results must match one unsharded CPU process taking the same steps.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from test_fsdp_backend import (  # the sharded-vs-single trajectory of the gloo test, and its reference
    TRAINER,
    WORLD,
    critic_config,
    critic_trajectory,
    make_batch,
    nonfinite_step,
    objective_step,
    single,  # noqa: F401 (a fixture)
)

pytestmark = [
    pytest.mark.gpu_twin,
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def _run_call_sites(rank: int, model_dir: str, tmp: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """Each call site in turn; a failing one is recorded and the next still runs (the dispatch error is
    raised before any rank communicates, so the ranks stay in step)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    import relax_core.backends.torch_backend as torch_backend
    from relax_core.backends import build_backend
    from relax_core.backends.base import max_over_ranks, reduce_metrics
    from relax_core.backends.fsdp_backend import FSDPBackend
    from relax_core.config.schema import ModelConfig
    from relax_core.roles.actor import Actor
    from relax_core.roles.critic import Critic
    from relax_models.loader import load_tokenizer

    out: dict[str, Any] = {}
    errors: dict[str, str] = {}

    def site(name: str, fn: Callable[[], Any]) -> None:
        try:
            out[name] = fn()
        except (Exception, CheckpointException):  # DCP's is a BaseException
            errors[name] = traceback.format_exc()

    twin = torch.device("twin", 0)
    try:  # the strictness itself: a CPU tensor cannot enter this group
        dist.all_reduce(torch.ones(1))
    except RuntimeError as err:
        out["cpu_tensor_error"] = str(err)
    torch_backend.role_device = lambda: twin  # what role_device() returns on a GPU node: the accelerator
    batch = make_batch(load_tokenizer(model_dir))
    site("reduce_metrics", lambda: reduce_metrics({"loss": rank + 1.0, "kl": 2.0 * rank}, twin))
    site("max_over_ranks", lambda: max_over_ranks(5 + rank, twin))
    torch.manual_seed(3)
    backend = FSDPBackend(model_dir, TRAINER, ModelConfig())
    out["device"] = str(next(backend.model.parameters()).device)
    # the steps of test_fsdp_backend.trajectory, one call site at a time
    site("logprobs", lambda: backend.forward_logprobs(batch, 3))
    site("step1", lambda: objective_step(backend, batch, micro=2))
    site("weights1", backend.state_dict)
    site("save_checkpoint", lambda: backend.save_checkpoint(str(tmp / "ckpt")))
    site("step2", lambda: objective_step(backend, batch, micro=2))
    site("weights2", backend.state_dict)
    site("sum_over_ranks", lambda: backend.sum_over_ranks([float(rank), 0.5]))
    site("nonfinite", lambda: nonfinite_step(backend, batch, rank))  # the skip decided on the device

    def resume() -> dict[str, float]:
        resumed = FSDPBackend(model_dir, TRAINER, ModelConfig())
        resumed.load_checkpoint(str(tmp / "ckpt"))
        return objective_step(resumed, batch, micro=2)

    site("resumed_step2", resume)

    def reference() -> torch.Tensor:
        frozen = build_backend(
            "torch", model_dir, TRAINER, ModelConfig(), 1.0, 0, trainable=False, sharded=True
        )
        return frozen.forward_logprobs(batch, 3)

    site("reference", reference)
    site("critic", lambda: critic_trajectory(Critic(critic_config(), model_dir, sharded=True), batch))
    actor = Actor.__new__(Actor)  # only the staleness gather: its rank count, not a model
    actor.ranks = WORLD
    site("from_every_rank", lambda: actor._from_every_rank([rank, 10 + rank]))
    return out, errors


def _worker(rank: int, port: int, model_dir: str, tmp: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        import torch.distributed as dist
        from twin.twin_device import DEVICE, load

        load()
        # started before any backend does (cpu_shim.init_process_group then keeps it): the twin group
        dist.init_process_group(DEVICE, rank=rank, world_size=WORLD)
        out, errors = _run_call_sites(rank, model_dir, Path(tmp))
    except Exception:
        out, errors = {}, {"setup": traceback.format_exc()}
    torch.save({"out": out, "errors": errors}, Path(tmp) / f"result{rank}.pt")


@pytest.fixture(scope="module")
def twin(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """Both ranks' results and errors (the first run on a machine builds the twin device, ~40 s)."""
    from relax_models.ports import free_port

    tmp = tmp_path_factory.mktemp("twin")
    mp.start_processes(
        _worker, args=(free_port(), str(tiny_model_dir), str(tmp)), nprocs=WORLD, start_method="spawn"
    )
    results = {rank: torch.load(tmp / f"result{rank}.pt", weights_only=False) for rank in range(WORLD)}
    for rank in range(WORLD):
        assert "setup" not in results[rank]["errors"], results[rank]["errors"]["setup"]
    return results


def _site(twin: dict[int, dict[str, Any]], name: str) -> list[Any]:
    """Every rank's result of call site ``name``; the test fails with the rank's traceback if it raised."""
    for rank in range(WORLD):
        assert name not in twin[rank]["errors"], f"rank {rank}:\n{twin[rank]['errors'][name]}"
    return [twin[rank]["out"][name] for rank in range(WORLD)]


def test_the_twin_group_refuses_cpu_tensors_as_nccl_does(twin) -> None:
    for rank in range(WORLD):
        assert "No backend type associated with device type cpu" in twin[rank]["out"]["cpu_tensor_error"]
        assert twin[rank]["out"]["device"] == "twin:0"  # the model computes on the twin device


def test_metric_and_width_reductions_run_on_the_device(twin) -> None:
    """``reduce_metrics`` (FSDP and megatron data-parallel metrics) and ``max_over_ranks`` (megatron's MoE
    width): loss summed, the rest averaged, the widest of the ranks."""
    assert _site(twin, "reduce_metrics") == [{"loss": 3.0, "kl": 1.0}] * WORLD
    assert _site(twin, "max_over_ranks") == [6] * WORLD


def test_fsdp_actor_scores_trains_and_publishes_like_one_cpu_rank(twin, single) -> None:  # noqa: F811
    for name in ("logprobs", "step1", "weights1", "step2", "weights2"):
        _site(twin, name)
    for rank in range(WORLD):
        r = twin[rank]["out"]
        assert r["logprobs"].device.type == "cpu"
        torch.testing.assert_close(r["logprobs"], single["logprobs"], rtol=1e-5, atol=1e-5)
        for step in ("step1", "step2"):
            assert r[step]["loss"] == pytest.approx(single[step]["loss"], rel=1e-5, abs=1e-6)
            assert r[step]["grad_norm"] == pytest.approx(single[step]["grad_norm"], rel=1e-5)
        for weights in ("weights1", "weights2"):
            assert sorted(r[weights]) == sorted(single[weights])
            for name, want in single[weights].items():
                # the twin takes torch's device paths (foreach kernels where the CPU loops): sums round in
                # another order, and Adam's first step turns that into up to ~2% of lr on elements whose
                # gradient is near zero
                torch.testing.assert_close(r[weights][name], want, rtol=1e-5, atol=TRAINER.lr / 20, msg=name)
    assert _site(twin, "sum_over_ranks") == [[1.0, 1.0]] * WORLD  # the streamed step's totals


def test_fsdp_ranks_skip_a_non_finite_update_together_on_the_device(twin) -> None:
    for got in _site(twin, "nonfinite"):
        assert got["metrics"]["train/skipped_steps"] == 1.0 and got["unchanged"]


def test_fsdp_checkpoint_saves_and_resumes_exactly(twin) -> None:
    _site(twin, "save_checkpoint")
    for rank, resumed in enumerate(_site(twin, "resumed_step2")):
        want = twin[rank]["out"]["step2"]
        assert resumed["loss"] == want["loss"] and resumed["grad_norm"] == want["grad_norm"]


def test_sharded_reference_and_critic_run_on_the_device(twin, single) -> None:  # noqa: F811
    for logprobs in _site(twin, "reference"):
        torch.testing.assert_close(logprobs, single["logprobs"], rtol=1e-5, atol=1e-5)
    want = single["critic"]
    for got in _site(twin, "critic"):
        assert got["kind"] == "ShardedValueBackend"
        for step in (1, 2):
            torch.testing.assert_close(got[f"values{step}"], want[f"values{step}"], rtol=1e-5, atol=1e-6)
            for key in ("critic/vf_loss", "critic/grad_norm"):
                assert got[f"fit{step}"][key] == pytest.approx(want[f"fit{step}"][key], rel=1e-5, abs=1e-7)


def test_actor_staleness_gather_runs_on_the_group(twin) -> None:
    assert _site(twin, "from_every_rank") == [[0, 10, 1, 11]] * WORLD
