"""The megatron backend through the launcher: checks before Ray starts, the shared LR schedule, and GRPO
runs end to end (megatron TP=1 against the torch backend; TP=2 as two Actor ranks in one gloo group, in
colocate and in ``mode=async`` at staleness 0, which must take colocate's steps).

The end-to-end runs go through ``relax_launch.run.run_experiment`` in this process (a real local Ray
cluster, real Actor/Rollout actors, real metrics files); the error cases go through
``python -m relax_launch`` in a subprocess, as a user would see them.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import launching
import pytest

from relax_core.backends.schedule import lr_multiplier
from relax_core.config.schema import TrainerConfig
from relax_core.errors import RelaxUserError
from relax_core.runtime.placement import rank_env
from relax_models.megatron.launch import check_megatron_launch, training_world_size

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


def _compose(overrides: list[str]) -> Any:
    """The typed config ``python -m relax_launch <overrides>`` would run."""
    from hydra import compose, initialize_config_module

    import relax_launch.cli as cli  # registers the schema with Hydra's ConfigStore

    with initialize_config_module(cli.CONFIG_MODULE, version_base="1.3"):
        return compose("config", overrides=overrides)


# ---------------------------------------------------------------------------------------------- fast


@pytest.mark.parametrize(
    ("sizes", "world"),
    [
        ({}, 1),
        ({"tensor": 2}, 2),
        ({"expert": 2}, 2),  # EP ranks are carved out of data-parallel ranks: 2 processes
        ({"tensor": 2, "expert": 2, "expert_tensor": 1}, 2),
        ({"tensor": 2, "expert": 4, "expert_tensor": 1}, 4),
        ({"tensor": 3, "expert": 2}, 6),  # expert_tensor defaults to tensor: lcm(3, 3 x 2)
    ],
)
def test_training_world_size_fits_every_parallel_group(sizes: dict, world: int) -> None:
    assert training_world_size(sizes) == world


def test_rank_env_is_what_init_process_group_reads() -> None:
    env = rank_env(1, 2, "group-a")  # MASTER_ADDR/PORT: the rank's own join_rendezvous, where Ray put it
    assert env == {"RANK": "1", "WORLD_SIZE": "2", "RELAX_RENDEZVOUS": "group-a"}


def test_lr_schedule_warm_up_then_cosine_to_the_floor() -> None:
    cfg = TrainerConfig(lr_warmup_steps=2, total_steps=10, lr_decay="cosine", min_lr_ratio=0.1)
    m = lr_multiplier(cfg)
    # warm-up (s+1)/(W+1); then 0.1 + 0.9·(1 + cos(pi·(s-2)/8))/2; the floor holds after total_steps
    assert [m(0), m(1), m(2)] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert m(6) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert m(10) == pytest.approx(0.1) and m(50) == pytest.approx(0.1)
    constant = lr_multiplier(TrainerConfig(lr_warmup_steps=1, total_steps=10, lr_decay="constant"))
    assert [constant(0), constant(1), constant(9)] == [0.5, 1.0, 1.0]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            ["trainer.megatron.tensor=3"],
            r"trainer.megatron.tensor=3 must divide the number of attention heads \(4\)",
        ),
        (
            ["trainer.megatron.tensor=8"],
            r"trainer.megatron.tensor=8 must divide the number of attention heads",
        ),
        (["model=qwen3_vl_4b"], r"model=qwen3_vl_4b is family 'qwen3_vl'"),
        (["trainer.megatron.pipeline=2"], r"trainer.megatron.pipeline=2.*set pipeline=1"),
        (["trainer.megatron.expert=2"], r"expert=2 needs a mixture-of-experts model"),
        (["trainer.megatron.tensor=0"], r"trainer.megatron.tensor=0 must be >= 1"),
    ],
)
def test_validation_names_the_setting_that_cannot_work(overrides: list[str], match: str) -> None:
    from omegaconf import OmegaConf

    from relax_core.preflight.validation import validate

    cfg = OmegaConf.to_object(_compose(["trainer=megatron", *overrides]))
    with pytest.raises(RelaxUserError, match=match):
        validate(cfg)


def test_validation_accepts_tensor_parallel_and_returns_the_world() -> None:
    from omegaconf import OmegaConf

    from relax_core.preflight.validation import validate

    cfg = OmegaConf.to_object(_compose(["trainer=megatron", "trainer.megatron.tensor=2"]))
    validate(cfg)
    assert check_megatron_launch(cfg) == 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["trainer=megatron", "trainer.megatron.tensor=3"],
            "error: trainer.megatron.tensor=3 must divide the number of attention heads (4)",
        ),
        (
            ["trainer=megatron", "model=qwen3_vl_4b"],
            "error: trainer.backend=megatron trains model families ['qwen3', 'qwen3_moe']; "
            "model=qwen3_vl_4b is family 'qwen3_vl': use trainer=torch for it",
        ),
    ],
)
def test_cli_reports_one_line_before_ray_starts(
    tmp_path: Path, overrides: list[str], message: str, relax_launch_cmd: list[str]
) -> None:
    proc = launching.launch(
        tmp_path, *overrides, cwd=tmp_path, timeout=300, check=False, command=relax_launch_cmd
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines[-1] == message
    assert "Traceback" not in proc.stderr
    assert "Ray up" not in proc.stdout + proc.stderr  # refused before any cluster work
    assert not (tmp_path / "model_init").exists()  # nor was the model built


# ---------------------------------------------------------------------------------------------- slow

# short but real: the default task (digit sorting, 40-step warm-start) with fewer RL steps
RUN_STEPS = 30
COMMON = [
    f"trainer.total_steps={RUN_STEPS}",
    "trainer.sft_warmup_steps=40",
    "trainer.eval_every=10",
    "cluster.num_cpus=4",
    "logger.plot=false",
    "seed=1",
]


def _run(tmp_path: Path, name: str, overrides: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One run through the launcher's ``run_experiment``: (summary, metrics.jsonl rows)."""
    from relax_launch.run import run_experiment

    cfg = _compose(overrides)
    cfg.output_dir = str(tmp_path / name)
    summary = run_experiment(cfg)
    rows = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    return summary, rows


def _by_step(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {row["step"]: row for row in rows}


@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory) -> dict[str, tuple[dict[str, Any], dict[int, dict[str, Any]]]]:
    root = tmp_path_factory.mktemp("megatron_runs")
    runs = {}
    for name, backend in (("torch", "trainer=torch"), ("megatron", "trainer=megatron")):
        summary, rows = _run(root, name, [backend, *COMMON])
        runs[name] = (summary, _by_step(rows))
    return runs


@pytest.mark.slow
def test_megatron_grpo_learns_and_tracks_the_torch_backend(grpo_runs) -> None:
    """Same seed, data order and sampling seeds, and the two backends compute the same function up to
    float rounding: warm-start and the first RL steps see the same samples (measured: identical rewards
    for steps 1-3). Afterwards one differently sampled token splits the runs, so later steps are compared
    as curves: the 30-step mean rewards differed by 0.003 when measured, and the per-step reward varies
    by ~0.04 between steps, so 0.05 leaves room for noise and still catches a backend that learns
    differently (the reward rises by ~0.1 over these 30 steps)."""
    (t_sum, torch_rows), (m_sum, mega_rows) = grpo_runs["torch"], grpo_runs["megatron"]
    assert t_sum["status"] == m_sum["status"] == "finished"
    assert m_sum["steps"] == RUN_STEPS
    # step 0: greedy evaluation after the warm-start
    assert mega_rows[0]["eval/reward"] == pytest.approx(torch_rows[0]["eval/reward"], abs=0.01)
    # first RL step: same samples, so the same rewards; entropy within float noise
    first_t, first_m = torch_rows[1], mega_rows[1]
    assert first_m["reward/mean"] == pytest.approx(first_t["reward/mean"], abs=0.01)
    assert first_m["entropy"] == pytest.approx(first_t["entropy"], rel=0.01)
    for step in (1, RUN_STEPS // 2, RUN_STEPS):  # one LR schedule (warm-up, cosine) for both
        assert mega_rows[step]["lr"] == pytest.approx(torch_rows[step]["lr"], rel=1e-6)
    assert mega_rows[RUN_STEPS]["lr"] < mega_rows[1]["lr"]  # trainer=megatron follows lr_decay=cosine

    def mean_reward(rows: dict[int, dict[str, Any]], steps: range) -> float:
        return sum(rows[s]["reward/mean"] for s in steps) / len(steps)

    every = range(1, RUN_STEPS + 1)
    assert abs(mean_reward(mega_rows, every) - mean_reward(torch_rows, every)) < 0.05
    # learning: the last third of the run beats the first third
    first, last = range(1, RUN_STEPS // 3 + 1), range(RUN_STEPS - RUN_STEPS // 3 + 1, RUN_STEPS + 1)
    assert mean_reward(mega_rows, last) > mean_reward(mega_rows, first) + 0.03


# two tensor-parallel Actor ranks, 3 steps of 4 prompts x 4 samples after a 2-step warm-start
TP2_RUN = ["trainer=megatron", "trainer.megatron.tensor=2", "trainer.sft_warmup_steps=2", "seed=1"]
TP2_RUN += ["trainer.total_steps=3", "trainer.eval_every=0", "rollout.batch_size=4"]
TP2_RUN += ["rollout.n_samples_per_prompt=4", "trainer.micro_batch_size=4", "data.num_train=64"]
TP2_RUN += ["data.num_eval=8", "rollout.num_threads=1", "trainer.num_threads=1", "cluster.num_cpus=4"]
TP2_RUN += ["logger.plot=false"]


@pytest.mark.slow
def test_async_tensor_parallel_at_staleness_zero_takes_the_colocate_steps(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """mode=async with trainer=megatron: both TP ranks stream the same rows of a step from the bus and rank 0
    publishes the whole model. At max_staleness=0 every step is sampled by the version it trains from, so
    the run takes colocate's steps: same samples (rewards), same loss and gradient norm."""
    colocate_sum, colocate = _run(tmp_path, "colocate", [*TP2_RUN, "mode=colocate"])
    with caplog.at_level(logging.INFO, logger="relax"):
        # rollout_chunk_prompts=2: chunks are ignored at staleness 0, else 2 engine calls draw other tokens
        async_run = [*TP2_RUN, "mode=async", "mode.max_staleness=0", "mode.rollout_chunk_prompts=2"]
        async_sum, streamed = _run(tmp_path, "async", async_run)
    assert colocate_sum["status"] == async_sum["status"] == "finished"
    assert "actorx2" in caplog.text
    a = [r for r in colocate if r["step"] > 0]
    b = [r for r in streamed if r["step"] > 0]
    assert [r["step"] for r in b] == [r["step"] for r in a] == [1, 2, 3]
    assert sum(r["reward/mean"] for r in a) > 0  # some samples are rewarded, so equal rewards are telling
    for ra, rb in zip(a, b, strict=True):
        assert rb["staleness/max"] == 0 and rb["off_policy/train_rollout_abs_diff"] < 1e-4, rb
        assert rb["reward/mean"] == ra["reward/mean"] and rb["reward/std"] == ra["reward/std"], rb["step"]
        assert (rb["loss"], rb["grad_norm"]) == (ra["loss"], ra["grad_norm"]), rb["step"]
