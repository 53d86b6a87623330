"""The algorithm spec: what each shipped algorithm and each override needs from the engine.

Expected values are written by hand from the rules the engine followed before the spec existed
(validation, async_loop.uses_actor_fwd / advantage_inputs / GROUP_LOCAL_ESTIMATORS, needs_reference,
Controller.annotate at 91cbfab; relax_core/modes/plan.py after), not computed by the code under test.
The default run: 16 prompts x 8 samples = 128 samples per step, no global_batch_size, ppo_epochs 1,
mode=colocate.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import launching
import pytest
import yaml

from relax_core.algorithms import ADVANTAGE_ESTIMATORS
from relax_core.algorithms.spec import (
    ALGORITHM_SPECS,
    ESTIMATOR_SPECS,
    Requirements,
    needs_old_logprobs,
    requirements,
)
from relax_core.errors import RelaxUserError
from relax_core.preflight.validation import validate
from tests.core.conftest import typed_config

CONF = Path(__file__).resolve().parents[2] / "conf" / "algorithm"
ADV = ["advantages"]


def needs(
    *,
    reference=False,
    critic=False,
    teacher=False,
    actor_fwd=False,
    advantage_inputs=(),
    group_local=True,
    min_group_size=2,
    train_fields=ADV,
    model_roles=(),
) -> Requirements:
    return Requirements(
        reference=reference,
        critic=critic,
        teacher=teacher,
        actor_fwd=actor_fwd,
        advantage_inputs=tuple(advantage_inputs),
        group_local=group_local,
        min_group_size=min_group_size,
        train_fields=tuple(train_fields),
        model_roles=tuple(model_roles),
    )


REINFORCE_PP = needs(
    reference=True,
    advantage_inputs=["ref_logprobs"],
    group_local=False,  # whitened over the whole batch
    min_group_size=1,
    train_fields=ADV + ["ref_logprobs"],
    model_roles=["reference"],
)
DEFAULTS = {
    "grpo": needs(),  # std-normalised groups: n >= 2
    "dr_grpo": needs(),  # no std division, still a group mean: a group of one has A = 0
    "dapo": needs(),
    "gspo": needs(),
    "sapo": needs(),
    "cispo": needs(),
    "rloo": needs(),
    "reinforce": needs(min_group_size=1),
    "reinforce_pp": REINFORCE_PP,
    "reinforce_pp_baseline": replace(REINFORCE_PP, min_group_size=2),  # group-mean baseline
    "ppo": needs(
        critic=True, advantage_inputs=["values"], group_local=False, min_group_size=1, model_roles=["critic"]
    ),
    "opd": needs(teacher=True, advantage_inputs=["teacher_logprobs"], model_roles=["teacher"]),
}


def test_every_algorithm_config_has_a_spec_and_every_estimator_a_record():
    assert sorted(p.stem for p in CONF.glob("*.yaml")) == ALGORITHM_SPECS.names() == sorted(DEFAULTS)
    assert ESTIMATOR_SPECS.names() == ADVANTAGE_ESTIMATORS.names()


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_spec_matches_its_config_file(name):
    spec, cfg = ALGORITHM_SPECS.get(name), typed_config(f"algorithm={name}")
    a = cfg.algorithm
    assert (spec.advantage_estimator, spec.policy_loss, spec.loss_agg_mode) == (
        a.advantage_estimator,
        a.policy_loss,
        a.loss_agg_mode,
    )
    assert (spec.norm_adv_by_std, spec.dynamic_sampling) == (a.norm_adv_by_std, a.dynamic_sampling)
    assert (spec.critic, spec.teacher, spec.reward_kl) == (
        a.critic is not None,
        a.teacher is not None,
        a.kl_reward_coef > 0,
    )
    assert (spec.group_local, spec.min_group_size) == (
        DEFAULTS[name].group_local,
        DEFAULTS[name].min_group_size,
    )


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_default_requirements(name):
    cfg = typed_config(f"algorithm={name}")
    validate(cfg)
    assert requirements(cfg) == DEFAULTS[name]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        # a KL loss term: the Reference runs and the Actor trains on its log-probs; advantages do not wait
        (
            ["algorithm.kl_loss_coef=0.1"],
            needs(reference=True, train_fields=ADV + ["ref_logprobs"], model_roles=["reference"]),
        ),
        # 64 of 128 samples per optimizer step: two steps per rollout batch need the behaviour log-probs
        (["trainer.global_batch_size=64"], needs(actor_fwd=True, train_fields=ADV + ["old_logprobs"])),
        (["trainer.global_batch_size=128"], needs()),
        (["algorithm.ppo_epochs=2"], needs(actor_fwd=True, train_fields=ADV + ["old_logprobs"])),
        # ActorFwd is its own role only in mode=async
        (
            ["mode=async", "trainer.global_batch_size=64"],
            needs(actor_fwd=True, train_fields=ADV + ["old_logprobs"], model_roles=["actor_fwd"]),
        ),
        # composed from parts: the configured estimator decides, not the algorithm's name
        (["algorithm.advantage_estimator=rloo"], needs()),
        (["algorithm.advantage_estimator=rloo", "algorithm.norm_adv_by_std=false"], needs()),
        (["algorithm.norm_adv_by_std=false"], needs()),
        (["algorithm.advantage_estimator=reinforce_pp"], needs(group_local=False, min_group_size=1)),
        (["algorithm=dr_grpo", "algorithm.dynamic_sampling=true"], needs()),  # spread needs two samples
    ],
)
def test_grpo_overrides(overrides, expected):
    cfg = typed_config(*overrides)
    validate(cfg)
    assert requirements(cfg) == expected


def test_reward_kl_with_several_optimizer_steps_waits_for_behaviour_logprobs():
    cfg = typed_config("algorithm=reinforce_pp", "algorithm.ppo_epochs=2", "mode=async")
    assert requirements(cfg) == needs(
        reference=True,
        actor_fwd=True,
        advantage_inputs=["ref_logprobs", "old_logprobs"],
        group_local=False,
        min_group_size=1,
        train_fields=ADV + ["ref_logprobs", "old_logprobs"],
        model_roles=["actor_fwd", "reference"],
    )


def test_distillation_with_several_optimizer_steps_waits_for_behaviour_logprobs():
    cfg = typed_config("algorithm=opd", "trainer.global_batch_size=32")
    assert requirements(cfg).advantage_inputs == ("teacher_logprobs", "old_logprobs")
    assert requirements(cfg).model_roles == ("teacher",)  # colocate: the Actor runs that forward


def test_ppo_with_a_kl_loss_launches_reference_before_critic():
    cfg = typed_config("algorithm=ppo", "algorithm.kl_loss_coef=0.05")
    assert requirements(cfg).model_roles == ("reference", "critic")
    assert requirements(cfg).advantage_inputs == ("values",)


def test_old_logprobs_follow_the_size_of_the_batch_actually_trained():
    """Colocate decides per batch: dynamic sampling can keep fewer samples than a full step."""
    cfg = typed_config("trainer.global_batch_size=64")
    assert needs_old_logprobs(cfg, 128) and not needs_old_logprobs(cfg, 64)
    assert not needs_old_logprobs(typed_config(), 128)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["algorithm=rloo", "rollout.n_samples_per_prompt=1"],
            "algorithm rloo (rloo) needs rollout.n_samples_per_prompt >= 2 (a leave-one-out baseline), got 1",
        ),
        (
            ["algorithm=grpo", "algorithm.advantage_estimator=rloo", "rollout.n_samples_per_prompt=1"],
            "algorithm grpo (rloo) needs rollout.n_samples_per_prompt >= 2 (a leave-one-out baseline), got 1",
        ),
        (
            ["algorithm=gspo", "rollout.n_samples_per_prompt=1"],
            "algorithm gspo (grpo) needs rollout.n_samples_per_prompt >= 2 (a group to normalise over), got 1",
        ),
        (
            ["algorithm=dr_grpo", "rollout.n_samples_per_prompt=1"],
            "algorithm dr_grpo (grpo) needs rollout.n_samples_per_prompt >= 2 (a group to normalise over), got 1",
        ),
        (
            ["algorithm=reinforce", "algorithm.dynamic_sampling=true", "rollout.n_samples_per_prompt=1"],
            "algorithm.dynamic_sampling needs rollout.n_samples_per_prompt >= 2 (reward spread), got 1",
        ),
        (["algorithm=opd", "algorithm.teacher=null"], "algorithm opd needs algorithm.teacher"),
        (
            ["algorithm=grpo", "algorithm.advantage_estimator=gae"],
            "advantage_estimator=gae needs a value model: set algorithm.critic (e.g. algorithm=ppo)",
        ),
        (
            ["algorithm=grpo", "algorithm.clip_c=1.0"],
            "algorithm.clip_c (dual clip) must be > 1 or null, got 1.0",
        ),
    ],
)
def test_spec_rules_fail_with_one_line_naming_the_key(overrides, message):
    with pytest.raises(RelaxUserError) as err:
        validate(typed_config(*overrides))
    assert str(err.value) == message


def test_a_group_of_one_is_fine_where_no_rule_needs_a_group():
    for name in ("reinforce", "reinforce_pp", "ppo"):
        validate(typed_config(f"algorithm={name}", "rollout.n_samples_per_prompt=1"))


def test_reinforce_config_file_is_the_documented_example():
    """docs/architecture.md "Adding an algorithm" shows this file; keep them the same."""
    docs = (CONF.parents[1] / "docs" / "architecture.md").read_text()
    assert (CONF / "reinforce.yaml").read_text() in docs
    assert yaml.safe_load((CONF / "reinforce.yaml").read_text())["advantage_estimator"] == "reinforce"


@pytest.mark.slow
def test_reinforce_trains_through_the_launcher(tmp_path):
    """The worked example end to end: composed, validated and trained for three steps."""
    overrides = ["algorithm=reinforce", "trainer.total_steps=3", "trainer.sft_warmup_steps=0", "logger=jsonl"]
    # the held-out evals before and after training are not what this checks: 8 prompts, not 128 (x 8
    # samples each), which took most of the run
    launching.launch(tmp_path, *overrides, "data.num_eval=8", cwd=tmp_path, timeout=900)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 3
