"""MegatronBackend against TorchBackend on the same HF folders: log-probs, optimizer steps, weights,
checkpoints and HF export. Single process here; TP=2 / EP=2 across two gloo processes at the end."""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from megatron_twins import make_hf_model, moe_config
from tiny_dims import SMALL_DIMS

from relax_core.backends.megatron_backend import MegatronBackend
from relax_core.backends.torch_backend import TorchBackend
from relax_core.config.schema import ModelConfig, TrainerConfig
from relax_core.errors import RelaxUserError
from relax_core.samples import Sample, TrainBatch
from relax_models.ports import free_port
from relax_models.tiny import build_tiny_qwen3
from relax_models.tokenizer import build_char_tokenizer

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
torch.set_num_threads(1)

DENSE_DIMS = {**SMALL_DIMS, "head_dim": 24, "max_position_embeddings": 64, "initializer_range": 0.1}


# the torch backend's loader checks the checkpoint against model.family
MODEL_CFGS = {"dense": ModelConfig(), "moe": ModelConfig(family="qwen3_moe")}


def _trainer_cfg(**overrides: Any) -> TrainerConfig:
    # grad_clip well below the gradient norm, so clipping is exercised
    kw = dict(lr=1e-3, weight_decay=0.01, betas=[0.9, 0.99], grad_clip=0.05, lr_warmup_steps=1)
    kw.update(overrides)
    return TrainerConfig(**kw)


def _model_folder(root: Path, family: str) -> str:
    folder = root / family
    if family == "dense":
        return str(build_tiny_qwen3(folder, seed=3, **DENSE_DIMS))
    tokenizer = build_char_tokenizer()
    hf = make_hf_model(moe_config(vocab_size=len(tokenizer), mlp_only_layers=[1]))
    hf.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def folders(megatron_world, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("megatron_models")
    return {family: _model_folder(root, family) for family in ("dense", "moe")}


def _batch(seed: int = 0, n: int = 6) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        p_len = int(torch.randint(3, 7, (1,), generator=gen))
        r_len = int(torch.randint(1, 6, (1,), generator=gen))
        samples.append(
            Sample(
                group_id=i // 2,
                index_in_group=i % 2,
                prompt_ids=torch.randint(3, 90, (p_len,), generator=gen).tolist(),
                response_ids=torch.randint(3, 90, (r_len,), generator=gen).tolist(),
                rollout_logprobs=[0.0] * r_len,
                loss_mask=[1] * r_len,
                reward=float(i % 3),
            )
        )
    batch = TrainBatch.from_samples(samples, pad_token_id=0)
    batch.extras["advantages"] = (batch.rewards - batch.rewards.mean()).unsqueeze(1) * batch.loss_mask
    return batch


def _loss_fn(total_tokens: float):
    """Policy-gradient surrogate with an entropy bonus, token-mean over the whole optimizer batch."""

    def loss_fn(micro: TrainBatch, logprobs: torch.Tensor, entropy: torch.Tensor):
        mask = micro.loss_mask
        per_token = -micro.extras["advantages"] * logprobs - 0.01 * entropy
        loss = (per_token * mask).sum() / total_tokens
        return loss, {"entropy": float((entropy * mask).sum() / mask.sum())}

    return loss_fn


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_forward_logprobs_match_the_torch_backend(folders, family: str) -> None:
    batch = _batch()
    mega = MegatronBackend(folders[family], _trainer_cfg(), MODEL_CFGS[family], seed=1, trainable=False)
    ref = TorchBackend(folders[family], _trainer_cfg(), MODEL_CFGS[family], trainable=False)
    got, expected = mega.forward_logprobs(batch, 4), ref.forward_logprobs(batch, 4)
    assert got.shape == expected.shape == batch.loss_mask.shape
    assert (got - expected).abs().max().item() < 1e-5
    with pytest.raises(RuntimeError, match="frozen"):
        mega.train_step(batch, _loss_fn(1.0), 4)


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_train_steps_match_the_torch_backend(folders, family: str) -> None:
    """Two AdamW steps with micro-batch accumulation, active clipping and the shared cosine schedule
    (``relax_core.backends.schedule``) give the same weights and learning rates."""
    # warm-up 1, cosine over 3 steps to 0.2: the lr after steps 1 and 2 is lr·1.0 and lr·(0.2 + 0.8·0.5)
    cfg = _trainer_cfg(lr_decay="cosine", total_steps=3, min_lr_ratio=0.2)
    expected_lr = [cfg.lr * 1.0, cfg.lr * 0.6]
    mega = MegatronBackend(folders[family], cfg, MODEL_CFGS[family], seed=1)
    ref = TorchBackend(folders[family], cfg, MODEL_CFGS[family])
    for step in range(2):
        batch = _batch(seed=step)
        loss_fn = _loss_fn(float(batch.loss_mask.sum()))
        m_metrics = mega.train_step(batch, loss_fn, micro_batch_size=4)
        r_metrics = ref.train_step(batch, loss_fn, micro_batch_size=4)
        assert m_metrics["grad_norm"] > cfg.grad_clip  # clipping was active
        for key in ("loss", "grad_norm", "lr", "entropy"):
            assert m_metrics[key] == pytest.approx(r_metrics[key], rel=1e-4, abs=1e-6), key
        assert m_metrics["lr"] == pytest.approx(expected_lr[step], rel=1e-9)
    assert _max_diff(mega.state_dict(), ref.state_dict()) < 1e-5
    batch = _batch(seed=9)
    assert (mega.forward_logprobs(batch) - ref.forward_logprobs(batch)).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_state_dict_loads_strictly_into_transformers_and_back(folders, family: str) -> None:
    from transformers import AutoModelForCausalLM

    mega = MegatronBackend(folders[family], _trainer_cfg(), MODEL_CFGS[family], seed=1)
    batch = _batch()
    loss_fn = _loss_fn(float(batch.loss_mask.sum()))
    mega.train_step(batch, loss_fn, micro_batch_size=6)
    trained = mega.state_dict()
    hf = AutoModelForCausalLM.from_pretrained(folders[family])
    hf.load_state_dict(trained, strict=True)  # exactly the in-memory module's names and shapes
    # a second backend loads the trained weights (module layout) and scores like the first one
    other = MegatronBackend(folders[family], _trainer_cfg(), MODEL_CFGS[family], seed=1, trainable=False)
    other.load_state_dict(trained)
    assert torch.equal(other.forward_logprobs(batch), mega.forward_logprobs(batch))
    assert _max_diff(other.state_dict(), trained) == 0.0


def test_weight_buckets_stream_every_checkpoint_tensor_within_budget(folders) -> None:
    from relax_models.megatron.bridge import SafetensorsCheckpoint

    mega = MegatronBackend(folders["moe"], _trainer_cfg(), MODEL_CFGS["moe"], seed=1, trainable=False)
    budget = 40_000
    buckets = list(mega.hf_weight_buckets(budget))
    names = [n for b in buckets for n, _ in b]
    assert len(names) == len(set(names))
    on_disk = SafetensorsCheckpoint(folders["moe"])
    assert set(names) == set(on_disk)
    for bucket in buckets:
        assert sum(t.numel() * t.element_size() for _, t in bucket) <= budget or len(bucket) == 1
    streamed = {n: t for b in buckets for n, t in b}
    assert all(torch.equal(streamed[k], on_disk[k]) for k in on_disk)


def test_checkpoint_resume_reproduces_the_next_step_exactly(folders, tmp_path) -> None:
    cfg = _trainer_cfg()
    mega = MegatronBackend(folders["moe"], cfg, MODEL_CFGS["moe"], seed=1)
    batches = [_batch(seed=s) for s in range(3)]
    fns = [_loss_fn(float(b.loss_mask.sum())) for b in batches]
    mega.train_step(batches[0], fns[0], 4)
    mega.save_checkpoint(str(tmp_path / "ckpt"))
    mega.train_step(batches[1], fns[1], 4)
    after_resume_point = mega.train_step(batches[2], fns[2], 4)
    expected = mega.state_dict()

    resumed = MegatronBackend(folders["moe"], cfg, MODEL_CFGS["moe"], seed=2)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    resumed.train_step(batches[1], fns[1], 4)
    again = resumed.train_step(batches[2], fns[2], 4)
    assert again == after_resume_point
    assert _max_diff(resumed.state_dict(), expected) == 0.0


@pytest.mark.gpu_twin
def test_bf16_model_steps_fp32_main_params(folders, tmp_path) -> None:
    """``model.dtype=bfloat16`` on CPU, as megatron's bf16 optimizer on GPU: the model computes in bf16 and
    AdamW steps fp32 main params, which take the whole lr-1e-6 step (a bf16 parameter rounds it away); the
    model's weights follow them rounded; a checkpoint keeps them."""
    lr, bf16 = 1e-6, ModelConfig(dtype="bfloat16")
    cfg = _trainer_cfg(lr=lr, weight_decay=0.0, lr_warmup_steps=0)
    mega = MegatronBackend(folders["dense"], cfg, bf16, seed=1)
    dtypes = {name: p.dtype for name, p in mega.model.named_parameters()}
    assert torch.bfloat16 in dtypes.values(), dtypes
    main = [p for group in mega.optimizer.param_groups for p in group["params"]]
    assert {p.dtype for p in main} == {torch.float32}
    before = [p.clone() for p in main]
    batch = _batch()
    mega.train_step(batch, _loss_fn(float(batch.loss_mask.sum())), 4)
    deltas = torch.cat([(p - b).abs().flatten() for p, b in zip(main, before)])
    # Adam's first step moves each element with a gradient by about lr, up to fp32 rounding near 1
    assert (deltas > lr / 2).float().mean() > 0.9 and deltas.max() <= 1.2 * lr
    state = [t for s in mega.optimizer.state.values() for k, t in s.items() if k != "step"]
    assert state and {t.dtype for t in state} == {torch.float32}
    assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(mega.model.parameters(), main))
    mega.save_checkpoint(str(tmp_path / "ckpt"))
    resumed = MegatronBackend(folders["dense"], cfg, bf16, seed=2)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    resumed_main = [p for group in resumed.optimizer.param_groups for p in group["params"]]
    assert all(torch.equal(a, b) for a, b in zip(resumed_main, main))


def test_checkpoint_from_other_parallel_sizes_is_refused(folders, tmp_path) -> None:
    mega = MegatronBackend(folders["dense"], _trainer_cfg(), MODEL_CFGS["dense"], seed=1)
    mega.save_checkpoint(str(tmp_path))
    meta = torch.load(next(tmp_path.glob("megatron_rank*.pt")), weights_only=False)
    meta["parallel"]["tensor"] = 2
    torch.save(meta, next(tmp_path.glob("megatron_rank*.pt")))
    with pytest.raises(RelaxUserError, match="parallel sizes"):
        mega.load_checkpoint(str(tmp_path))
    with pytest.raises(RelaxUserError, match="no megatron checkpoint"):
        mega.load_checkpoint(str(tmp_path / "missing"))


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_export_hf_is_loaded_by_transformers(folders, tmp_path, family: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    mega = MegatronBackend(folders[family], _trainer_cfg(), MODEL_CFGS[family], seed=1)
    batch = _batch()
    mega.train_step(batch, _loss_fn(float(batch.loss_mask.sum())), 6)
    mega.export_hf(str(tmp_path))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert AutoTokenizer.from_pretrained(tmp_path).eos_token == "<eos>"
    assert _max_diff(hf.state_dict(), mega.state_dict()) == 0.0
    ref = TorchBackend(str(tmp_path), _trainer_cfg(), MODEL_CFGS[family], trainable=False)
    assert (ref.forward_logprobs(batch) - mega.forward_logprobs(batch)).abs().max().item() < 1e-5


def test_unsupported_settings_are_user_errors(folders, tmp_path) -> None:
    with pytest.raises(RelaxUserError, match="pipeline"):
        MegatronBackend(
            folders["dense"], _trainer_cfg(), MODEL_CFGS["dense"], seed=1, parallel={"pipeline": 2}
        )
    with pytest.raises(RelaxUserError, match="not divisible"):
        MegatronBackend(folders["dense"], _trainer_cfg(), MODEL_CFGS["dense"], seed=1, parallel={"tensor": 2})
    with pytest.raises(RelaxUserError, match="model.dtype"):
        MegatronBackend(folders["dense"], _trainer_cfg(), ModelConfig(dtype="int8"), seed=1)
    (tmp_path / "config.json").write_text(Path(folders["dense"], "config.json").read_text())
    with pytest.raises(RelaxUserError, match="safetensors"):
        MegatronBackend(str(tmp_path), _trainer_cfg(), ModelConfig(), seed=1)


# ---------------------------------------------------------------------- two processes
# dp2: two data-parallel replicas, each training on its half of every batch; ep2 also has two replicas
PARALLEL_CASES = {
    "tp2_dense": ("dense", {"tensor": 2}),
    "dp2_dense": ("dense", {}),
    "ep2_moe": ("moe", {"expert": 2}),
}


def _parallel_worker(rank: int, port: int, folders: dict[str, str], out_dir: str) -> None:
    import os
    import warnings

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    for case, (family, parallel) in PARALLEL_CASES.items():
        try:
            mega = MegatronBackend(
                folders[family], _trainer_cfg(), MODEL_CFGS[family], seed=1, parallel=parallel
            )
            metrics = []
            for step in range(2):
                batch = _batch(seed=step)  # every rank gets the whole batch; DP replicas slice it
                metrics.append(mega.train_step(batch, _loss_fn(float(batch.loss_mask.sum())), 4))
            state = mega.state_dict()  # collective: every rank gathers
            result: dict[str, Any] = {"metrics": metrics, "state": state if rank == 0 else None}
        except Exception:
            result = {"error": traceback.format_exc()}
        # a file, not a queue: shared-memory tensors would die with the worker
        torch.save(result, Path(out_dir) / f"{rank}_{case}.pt")
        if "error" in result:
            raise RuntimeError(result["error"])


@pytest.fixture(scope="module")
def parallel_runs(folders, tmp_path_factory) -> dict[tuple[int, str], dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("parallel_runs")
    mp.start_processes(
        _parallel_worker, args=(free_port(), folders, str(out_dir)), nprocs=2, start_method="spawn"
    )
    return {
        (rank, case): torch.load(out_dir / f"{rank}_{case}.pt", weights_only=False)
        for rank in range(2)
        for case in PARALLEL_CASES
    }


@pytest.mark.parametrize("case", list(PARALLEL_CASES))
def test_two_process_training_matches_single_process_torch_backend(folders, parallel_runs, case: str) -> None:
    family, _ = PARALLEL_CASES[case]
    ref = TorchBackend(folders[family], _trainer_cfg(), MODEL_CFGS[family])
    ref_metrics = []
    for step in range(2):
        batch = _batch(seed=step)
        ref_metrics.append(ref.train_step(batch, _loss_fn(float(batch.loss_mask.sum())), 4))
    for rank in range(2):
        result = parallel_runs.get((rank, case))
        assert result is not None and "error" not in result, result
        for got, expected in zip(result["metrics"], ref_metrics, strict=True):
            assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
            assert got["loss"] == pytest.approx(expected["loss"], rel=1e-4, abs=1e-6)
    assert _max_diff(parallel_runs[(0, case)]["state"], ref.state_dict()) < 1e-5
