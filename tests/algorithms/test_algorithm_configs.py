"""Every algorithm composes from conf/algorithm/<name>.yaml; invalid combinations fail before Ray starts."""

from __future__ import annotations

import pytest

from relax_core.errors import RelaxUserError
from relax_core.preflight.validation import validate
from relax_launch.cli import composition_problem
from tests.core.conftest import typed_config

ALGORITHMS = [
    "grpo", "dr_grpo", "dapo", "gspo", "sapo", "cispo", "rloo",
    "reinforce", "reinforce_pp", "reinforce_pp_baseline", "ppo", "opd",
]  # fmt: skip


@pytest.mark.parametrize("name", ALGORITHMS)
def test_algorithm_composes_and_validates(name):
    cfg = typed_config(f"algorithm={name}")
    assert cfg.algorithm.name == name
    validate(cfg)


def test_algorithm_specifics_are_on_the_dataclass():
    assert typed_config("algorithm=dr_grpo").algorithm.loss_scale == 8  # ${rollout.max_new_tokens}
    assert typed_config("algorithm=dr_grpo", "rollout.max_new_tokens=12").algorithm.loss_scale == 12
    dapo = typed_config("algorithm=dapo").algorithm
    assert dapo.dynamic_sampling and dapo.overlong_buffer == 2 and dapo.clip_high > dapo.clip_low
    ppo = typed_config("algorithm=ppo").algorithm
    assert ppo.critic is not None and ppo.critic.warmup_steps >= 0 and ppo.advantage_estimator == "gae"
    opd = typed_config("algorithm=opd", "algorithm.teacher.coef=0.5").algorithm
    assert opd.teacher is not None and opd.teacher.coef == 0.5


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm=rloo", "rollout.n_samples_per_prompt=1"], "n_samples_per_prompt >= 2"),
        (["algorithm=reinforce_pp_baseline", "rollout.n_samples_per_prompt=1"], "n_samples_per_prompt >= 2"),
        (["algorithm=dr_grpo", "algorithm.loss_scale=0"], "loss_scale must be > 0"),
        (["algorithm=dr_grpo", "algorithm.loss_scale=-4"], "loss_scale must be > 0"),
        (["algorithm=ppo", "algorithm.critic=null"], "needs a value model"),
        (["algorithm=grpo", "algorithm.advantage_estimator=gae"], "needs a value model"),
        (["algorithm=sapo", "algorithm.tau_neg=0"], "tau_neg"),
        (["algorithm=dapo", "rollout.n_samples_per_prompt=1"], "n_samples_per_prompt >= 2"),
        (["algorithm=dapo", "algorithm.overlong_buffer=8"], "overlong_buffer"),
        (["algorithm=ppo", "algorithm.lam=1.5"], "algorithm.lam"),
        (["algorithm=grpo", "algorithm.tis_cap=0"], "tis_cap"),
        (["algorithm=grpo", "algorithm.kl_reward_coef=0.1"], "kl_reward_coef"),
        (["algorithm=opd", "algorithm.teacher.coef=0"], "teacher.coef"),
        (["algorithm=ppo", "algorithm.critic.value_clip=-1"], "value_clip"),
    ],
)
def test_invalid_combinations_fail_with_a_clear_message(overrides, message):
    cfg = typed_config(*overrides)
    with pytest.raises(RelaxUserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(cfg)


def test_unknown_algorithm_fails_at_composition():
    problem = composition_problem(["algorithm=ppo2"])
    assert problem is not None and "ppo2" in problem


def test_typo_in_algorithm_key_fails_at_composition():
    problem = composition_problem(["algorithm=sapo", "algorithm.tau_postive=2"])
    assert problem is not None and "tau_postive" in problem
