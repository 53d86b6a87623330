"""Each algorithm learns on the default task: a short run with every role in one process
(``cluster=in_process``, which gives a Ray run's rewards step for step), reward must rise.

Runs are kept small (a 40-step warm-start, 40 RL steps at lr 2e-3, the default 16 prompts x 8 samples) so the whole suite fits
the CI budget; the start is weak on purpose so there is room to improve. Each run uses one thread, so the
runs go two at a time, in spawned processes, on a host with two cores. The comparison is the mean train
reward of the last 10 steps against the first 10 (DAPO: over every generated sample, before filtering).
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from relax_launch.cli import CONFIG_MODULE

ALGORITHMS = [
    "grpo", "dr_grpo", "dapo", "gspo", "sapo", "cispo", "rloo",
    "reinforce_pp", "reinforce_pp_baseline", "ppo", "opd",
]  # fmt: skip
SMALL_RUN = [
    "trainer.total_steps=40",
    "trainer.sft_warmup_steps=40",
    "trainer.lr=2e-3",
    "trainer.eval_every=0",
    "logger=jsonl",
    "logger.plot=false",
    "cluster=in_process",
    "rollout.num_threads=1",
    "trainer.num_threads=1",
]


def run_algorithm(name: str, out_dir, extra: list[str]) -> tuple[dict, list[dict]]:
    from relax_core.preflight.validation import validate
    from relax_core.run_loop import RunLoop

    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        cfg = compose("config", overrides=[f"algorithm={name}", *SMALL_RUN, *extra])
    cfg.output_dir = str(out_dir)
    config = OmegaConf.to_object(cfg)
    validate(config)
    loop = RunLoop(config, OmegaConf.to_container(cfg, resolve=True))
    summary = loop.run()
    return summary, [m for m in loop.sink.history if m.get("step", 1) > 0]


def extra_overrides(name: str, teacher_cache) -> list[str]:
    return {
        # a shorter teacher schedule than the default keeps the suite in budget
        "opd": [f"algorithm.teacher.cache_dir={teacher_cache}", "algorithm.teacher.train_steps=120"],
        # one critic warm-up step instead of three: the actor gets most of the 40-step budget
        "ppo": ["algorithm.critic.warmup_steps=1"],
    }.get(name, [])


@pytest.fixture(scope="module")
def teacher_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("teachers")


@pytest.fixture(scope="module")
def learning_runs(tmp_path_factory, teacher_cache) -> dict[str, Future]:
    """Every algorithm's run, started at once on a pool of spawned processes (the longest first)."""
    longest_first = sorted(ALGORITHMS, key=lambda name: name not in ("ppo", "opd"))
    workers = min(2, os.cpu_count() or 1)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return {
            name: pool.submit(
                run_algorithm, name, tmp_path_factory.mktemp(name), extra_overrides(name, teacher_cache)
            )
            for name in longest_first
        }


@pytest.mark.slow
@pytest.mark.parametrize("name", ALGORITHMS)
def test_algorithm_reward_rises(name, learning_runs, teacher_cache):
    summary, history = learning_runs[name].result()
    assert summary["status"] == "finished" and summary["steps"] == 40
    key = "dynamic_sampling/reward_all_mean" if name == "dapo" else "reward/mean"
    rewards = [m[key] for m in history if key in m]
    assert len(rewards) == 40
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.02, f"{name}: reward {first:.3f} -> {last:.3f}"
    if name == "ppo":
        assert any("critic/vf_loss" in m for m in history)
    if name == "opd":
        assert (teacher_cache / "teachers").is_dir()
