"""``python -m relax_launch trainer=fsdp``: sharded helpers (Reference, Critic, Teacher) next to two FSDP Actor
ranks (real Ray actors, one gloo group), in colocate and async; bad rank settings fail before Ray starts.
Two ranks taking the one-rank run's steps and resuming from their shards: tests/multinode/ (on two nodes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from launching import RAY_NO_AUTH, launch, read_metrics, read_summary

from relax_core.errors import RelaxUserError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "resilience"))
from resilience_helpers import TINY_RUN  # noqa: E402

# the resilience tests' tiny run (2 warm-start steps, 4 prompts x 4 samples per RL step) on 2 FSDP ranks
TINY_FSDP_RUN = ["trainer=fsdp", "trainer.dp_size=2", *TINY_RUN]
RANK_FILES = ["fsdp_rank00000.pt", "fsdp_rank00001.pt"]  # what each sharded role saves


def _launch(run_dir: Path, overrides: list[str]) -> dict:
    launch(run_dir, *overrides, env=RAY_NO_AUTH)
    return read_summary(run_dir)


def _rewards(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["reward/mean"] for r in read_metrics(run_dir) if "reward/mean" in r}


# PPO with a KL loss: a Critic and a Reference next to the Actor, 3 steps (the policy waits for the critic
# in step 1), checkpointed at the end. Seed 2 draws some reward in every step, so the Critic has a return to
# fit each step (with an all-zero return, its zero-initialised head has vf_loss exactly 0).
PPO_KL_RUN = [
    *TINY_FSDP_RUN,
    "seed=2",
    "algorithm=ppo",
    "algorithm.kl_loss_coef=0.01",
    "algorithm.critic.warmup_steps=1",
    "trainer.total_steps=3",
    "trainer.save_every=3",
]


@pytest.fixture(scope="module")
def ppo_kl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The colocate run, on 2 logical CPUs: the sharded helpers split the CPUs of the Actor rank they sit
    next to, so all 7 processes fit."""
    run = tmp_path_factory.mktemp("fsdp") / "ppo_kl"
    two_cpus = [o for o in PPO_KL_RUN if not o.startswith("cluster.num_cpus=")] + ["cluster.num_cpus=2"]
    assert _launch(run, two_cpus)["status"] == "finished"
    return run


@pytest.mark.slow
def test_ppo_kl_run_shards_the_reference_and_critic_next_to_the_actor_ranks(ppo_kl: Path) -> None:
    """algorithm=ppo with kl_loss_coef > 0 starts a Critic and a Reference; with trainer=fsdp in colocate each
    runs as 2 FSDP ranks of its own gloo group (both score like the unsharded models: test_fsdp_backend.py)."""
    run = ppo_kl
    assert "FSDP-sharded helpers: critic, reference" in (run / "cli.log").read_text()
    for role in ("critic", "reference"):  # one shard file per rank: both roles ran as 2 FSDP ranks
        saved = run / "checkpoints" / "step_000003" / role
        assert sorted(p.name for p in saved.glob("fsdp_rank*.pt")) == RANK_FILES
    rows = [r for r in read_metrics(run) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["critic/vf_loss"] > 0 for r in rows)  # the sharded Critic fits every step
    assert rows[0]["critic/values_mean"] == 0.0 != rows[-1]["critic/values_mean"]  # zero head, then fitted
    assert rows[-1]["kl"] > 0  # step 3 trains a policy that moved away from the (sharded) Reference


@pytest.mark.slow
def test_distillation_run_shards_the_teacher_next_to_the_actor_ranks(tmp_path: Path) -> None:
    """algorithm=opd scores with a frozen Teacher; with trainer=fsdp in colocate it runs as 2 FSDP ranks of
    its own gloo group, like the Reference (same backend: test_fsdp_backend.py)."""
    run = tmp_path / "opd"
    # a briefly trained teacher: what is tested is where it runs, not what it knows
    teacher = [f"algorithm.teacher.cache_dir={tmp_path / 'teachers'}", "algorithm.teacher.train_steps=10"]
    summary = _launch(run, [*TINY_FSDP_RUN, "algorithm=opd", *teacher, "trainer.total_steps=2"])
    assert summary["status"] == "finished"
    assert "FSDP-sharded helpers: teacher" in (run / "cli.log").read_text()
    assert [r["step"] for r in read_metrics(run) if "reward/mean" in r] == [1, 2]


@pytest.mark.slow
def test_async_fsdp_ppo_kl_at_staleness_zero_takes_the_colocate_steps(ppo_kl: Path, tmp_path: Path) -> None:
    """mode=async with trainer=fsdp: the Actor, the Critic and the Reference each run as 2 FSDP ranks; the
    Actor's ranks stream their shares of a step from the bus, the scoring roles' rank 0 picks the rows and
    all ranks score them. At max_staleness=0 nothing is stale, so the run must take colocate's steps."""
    run = tmp_path / "async"
    summary = _launch(run, [*PPO_KL_RUN, "mode=async", "mode.max_staleness=0"])
    assert summary["status"] == "finished"
    assert "rolloutx1, actorx2, referencex2, criticx2, advantagesx1" in (run / "cli.log").read_text()
    for role in ("actor", "critic", "reference"):
        saved = run / "checkpoints" / "step_000003" / role
        assert sorted(p.name for p in saved.glob("fsdp_rank*.pt")) == RANK_FILES
    steps = [r for r in read_metrics(run) if "reward/mean" in r]
    colocate = {r["step"]: r for r in read_metrics(ppo_kl) if "reward/mean" in r}
    assert [r["step"] for r in steps] == [1, 2, 3]
    for row in steps:
        same = colocate[row["step"]]
        assert row["staleness/max"] == 0
        for key in ("reward/mean", "critic/values_mean", "critic/vf_loss", "kl", "loss"):
            assert row[key] == same[key], (row["step"], key, row[key], same[key])


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_module

    import relax_launch.cli  # noqa: F401  (registers the structured-config schema with Hydra)

    with initialize_config_module("relax_launch.conf", version_base="1.3"):
        return compose("config", overrides=overrides)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.dp_size=2"], r"trainer.dp_size=2 shards the Actor with FSDP: set trainer.fsdp=true"),
        (["trainer=fsdp", "trainer.dp_size=0"], r"trainer.dp_size=0 must be >= 1"),
        (
            ["trainer=fsdp", "trainer.dp_size=3"],
            r"rollout.batch_size x rollout.n_samples_per_prompt=128 does not divide over 3 data-parallel ranks",
        ),
        (
            ["trainer=fsdp", "trainer.global_batch_size=30", "trainer.dp_size=4"],
            r"trainer.global_batch_size=30 does not divide over 4",
        ),
        (["trainer=fsdp", "trainer.sft_batch_size=63"], r"trainer.sft_batch_size=63 does not divide over 2"),
        (["trainer.offload=true", "mode=async"], r"trainer.offload frees the device between colocate phases"),
    ],
)
def test_rank_settings_that_cannot_work_are_one_line_user_errors(overrides: list[str], message: str) -> None:
    from relax_core.preflight.validation import validate

    with pytest.raises(RelaxUserError, match=message) as error:
        validate(_compose(overrides))
    assert "\n" not in str(error.value)
