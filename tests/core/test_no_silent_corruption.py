"""No silent corruption (issue 45): rewards out of range are counted errors, non-finite updates are
skipped, runs training on nothing valid stop with one line, and NaN weights are never written."""

from __future__ import annotations

import math
import re
import traceback
from pathlib import Path

import pytest
import torch

from relax_core.data.prompts import generate_synthetic, load_prompts
from relax_core.databus import InMemoryDataBus
from relax_core.modes.base import ERROR_EXAMPLE, RoleGroups, reward_metrics
from relax_core.resilience.checkpoint import CheckpointManager, save_run
from relax_core.resilience.health import RunFailedError
from relax_core.roles.actor import Actor
from relax_core.roles.rollout import Rollout
from relax_core.run_loop import RunLoop
from relax_core.runtime.groups import RoleGroup
from relax_core.samples import Sample, TrainBatch
from relax_models.loader import load_tokenizer

HUGE_REWARD = "def huge(response, label, metadata=None):\n    return 1e300\n"


def huge_reward(tmp_path: Path) -> str:
    path = tmp_path / "huge_reward.py"
    path.write_text(HUGE_REWARD)
    return f"reward._target_={path}:huge"


def test_rollout_scores_an_out_of_range_reward_as_a_counted_error(make_cfg, tiny_model_dir, tmp_path):
    cfg = make_cfg("rollout.max_new_tokens=4", huge_reward(tmp_path))
    train_path, _ = generate_synthetic(cfg.data, tmp_path / "data", seed=3)
    prompts = load_prompts(train_path, cfg.data, load_tokenizer(str(tiny_model_dir)))[0][:2]
    rollout = Rollout(cfg, str(tiny_model_dir), bus=InMemoryDataBus())
    try:
        samples = rollout.generate(prompts)
        part = rollout.produce(1, prompts, [0, 1])  # what mode=async builds its step's reward metrics from
    finally:
        rollout.shutdown()
    assert all(s.reward == 0.0 and s.reward_extras["reward_error"] == 1.0 for s in samples)
    assert "reward.max_abs=1e+06" in samples[0].metadata["reward_error"]
    assert "reward_error" not in prompts[0].metadata  # the prompt's shared dict is left alone
    # mode=async's step metrics quote an example error too, for the TrainingGuard's stop message
    example = reward_metrics(part.reward_samples())[ERROR_EXAMPLE]
    assert re.fullmatch(r"sample \d+:\d+: reward 1e\+300 is outside .*reward\.max_abs=1e\+06.*", example)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_actor_skips_an_update_with_a_non_finite_loss(make_cfg, tiny_model_dir, poison):
    actor = Actor(make_cfg(), str(tiny_model_dir))
    before = {k: v.clone() for k, v in actor.backend.model.state_dict().items()}
    batch = TrainBatch.from_samples([Sample(0, i, [3, 4], [5, 6], [0.0, 0.0], [1, 1]) for i in range(2)], 0)

    def loss_fn(micro, logprobs, entropy):
        return logprobs.sum() * poison, {}

    out = actor.backend.train_step(batch, loss_fn, 8)
    assert out["train/skipped_steps"] == 1.0 and not math.isfinite(out["loss"])
    assert all(p.grad is None for p in actor.backend.model.parameters())
    after = actor.backend.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # a finite step afterwards trains as usual
    ok = actor.backend.train_step(batch, lambda m, lp, e: (-lp.sum(), {}), 8)
    assert ok["train/skipped_steps"] == 0.0 and math.isfinite(ok["grad_norm"])


def test_actor_refuses_to_write_nan_weights(make_cfg, tiny_model_dir, tmp_path):
    actor = Actor(make_cfg(), str(tiny_model_dir))
    with torch.no_grad():
        next(actor.backend.model.parameters()).fill_(float("nan"))
    for write in (actor.export_hf, actor.save_checkpoint):
        target = tmp_path / write.__name__
        with pytest.raises(RunFailedError, match="NaN or inf"):
            write(str(target))
        assert not target.exists()


def raised_in_driver(err: BaseException) -> bool:
    """Raised by driver code, not inside a role: under Ray a role's error reaches the command line wrapped
    under Ray's ``ray::...`` header, the driver's own as the one line it is."""
    return "relax_core/roles/" not in traceback.extract_tb(err.__traceback__)[-1].filename


def test_driver_refuses_to_checkpoint_nan_weights(make_cfg, tiny_model_dir, tmp_path):
    roles = RoleGroups(actor=RoleGroup(Actor, "actor", 1, None, [0], 0, 0, (make_cfg(), str(tiny_model_dir))))
    with torch.no_grad():
        next(roles.actor.actors[0].role.backend.model.parameters()).fill_(float("inf"))
    with pytest.raises(
        RunFailedError, match=r"not writing .*step_000003: 1 policy weight tensor\(s\)"
    ) as err:
        save_run(roles, CheckpointManager(tmp_path / "ckpt", 1, 2), 3, {})
    assert raised_in_driver(err.value) and len(str(err.value).splitlines()) == 1
    assert not (tmp_path / "ckpt").exists()


def test_a_run_whose_weights_diverge_writes_no_final_model(make_cfg, tiny_model_dir, tmp_path):
    # a real divergence: AdamW's first step at this lr and decay (both still float32 scalars) takes the unit
    # norm weights past float32's range, from a finite loss and gradient norm (so the step is not skipped)
    cfg = make_cfg(
        "cluster=in_process",
        "logger=jsonl",
        f"model.path={tiny_model_dir}",
        "trainer.total_steps=1",
        "trainer.sft_warmup_steps=0",
        "trainer.eval_every=0",
        "trainer.export_final_model=true",
        "trainer.lr=3e37",
        "trainer.weight_decay=11",
        "rollout.max_new_tokens=4",
    )
    with pytest.raises(RunFailedError, match=r"not writing .*final_model: \d+ policy weight tensor") as err:
        RunLoop(cfg, {}).run()
    assert raised_in_driver(err.value) and len(str(err.value).splitlines()) == 1
    assert not (tmp_path / "final_model").exists()


def test_guard_stops_after_consecutive_bad_steps(make_cfg):
    from relax_core.resilience.health import TrainingGuard

    t = make_cfg("trainer.total_steps=10").trainer
    guard = TrainingGuard(t)
    guard.check(1, {"reward/reward_error": 1.0})
    guard.check(2, {"reward/reward_error": 0.2})  # a good step resets the streak
    guard.check(3, {"train/skipped_steps": 1.0, "optimizer_steps": 1.0})
    guard.check(4, {"reward/reward_error": 0.75})
    with pytest.raises(RunFailedError, match=r"steps 3-5: 100% .*e\.g\. sample 0:1: boom"):
        guard.check(5, {"reward/reward_error": 1.0}, "sample 0:1: boom")
    short = TrainingGuard(make_cfg("trainer.total_steps=2").trainer)  # shorter than max_bad_steps
    short.check(1, {"train/skipped_steps": 1.0, "optimizer_steps": 1.0})
    with pytest.raises(RunFailedError, match="not finite"):
        short.check(2, {"train/skipped_steps": 1.0, "optimizer_steps": 1.0})


def test_a_run_with_a_huge_reward_stops_naming_it(make_cfg, tiny_model_dir, tmp_path):
    cfg = make_cfg(
        "cluster=in_process",
        "logger=jsonl",
        f"model.path={tiny_model_dir}",
        "trainer.total_steps=4",
        "trainer.sft_warmup_steps=0",
        "trainer.eval_every=0",
        "trainer.export_final_model=true",
        "rollout.max_new_tokens=4",
        # no evaluation before RL: it would stop the run first (the test below)
        "eval.sets.heldout.greedy=false",
        "eval.sets.heldout.n_samples=0",
        huge_reward(tmp_path),
    )
    with pytest.raises(RunFailedError, match=r"steps 1-3: 100% of the samples were reward errors.*max_abs"):
        RunLoop(cfg, {}).run()
    assert not (tmp_path / "final_model").exists()


@pytest.mark.parametrize("reward", ["huge", "slow"])
def test_an_evaluation_of_nothing_but_reward_errors_stops_the_run_before_rl(
    make_cfg, tiny_model_dir, tmp_path, reward
):
    """Every greedy eval sample a reward error (the run's reward out of range, or the eval set's own reward
    timing out): one line naming the reward and its first error, before the sampled pass and step 1."""
    if reward == "huge":
        scoring = huge_reward(tmp_path)
        cause = r"reward '.*huge_reward\.py:huge'; the first, sample \d+:\d+: reward 1e\+300 is outside .*"
    else:
        (tmp_path / "slow.py").write_text(
            "import time\ndef slow(response, label, metadata=None):\n    time.sleep(2)\n    return 1.0\n"
        )
        scoring = f"+eval.sets.heldout.reward={{_target_:'{tmp_path / 'slow.py'}:slow',timeout_s:0.2,num_workers:0}}"
        cause = (
            r"reward '.*slow\.py:slow'; the first, sample \d+:\d+: timed out "
            r"\(eval\.sets\.heldout\.reward\.timeout_s=0\.2: raise it if the reward is only slow\)"
        )
    cfg = make_cfg(
        "cluster=in_process",
        "logger=jsonl",
        f"model.path={tiny_model_dir}",
        "trainer.total_steps=2",
        "trainer.sft_warmup_steps=0",
        "rollout.max_new_tokens=4",
        scoring,
    )
    with pytest.raises(RunFailedError) as err:
        RunLoop(cfg, {}).run()
    assert re.fullmatch(
        rf"eval set heldout before RL: all 8 samples are reward errors of {cause}", str(err.value)
    )
    assert raised_in_driver(err.value)
