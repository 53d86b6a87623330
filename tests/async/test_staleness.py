"""The staleness gate, staleness metrics and the async-mode config rules."""

from __future__ import annotations

import re

import pytest

from relax_core.databus import sample_key
from relax_core.databus.stages import complete_groups
from relax_core.modes.asynchronous import StalenessGate
from relax_core.roles.actor import staleness_metrics


def test_gate_bounds_rollout_ahead_of_training() -> None:
    strict = StalenessGate(0)
    # oldest unconsumed step 1: only step 1 may be generated (colocate order)
    assert strict.may_start(1, 1) and not strict.may_start(2, 1)
    assert strict.may_start(2, 2)
    two = StalenessGate(2)
    assert two.may_start(3, 1) and not two.may_start(4, 1)
    assert two.may_start(6, 4) and not two.may_start(7, 4)
    # the engines' weights must be at most max_staleness versions behind what step s is trained from
    assert strict.min_weight_version(5) == 4
    assert two.min_weight_version(5) == 2 and two.min_weight_version(2) == 0
    with pytest.raises(ValueError):
        StalenessGate(-1)


def test_gate_replay_never_exceeds_max_staleness() -> None:
    """Simulate a rollout much faster than training: every admitted step's lag stays within the bound."""
    for max_staleness in (0, 1, 3):
        gate, trained, next_roll, lags = StalenessGate(max_staleness), 0, 1, []
        engine_version = 0
        while trained < 20:
            while gate.may_start(next_roll, trained + 1) and engine_version >= gate.min_weight_version(
                next_roll
            ):
                lags.append((next_roll - 1) - engine_version)  # version it trains from - generating version
                next_roll += 1
            trained += 1  # the Actor finishes the oldest step; its weights reach the engines
            engine_version = trained
        assert max(lags) == max_staleness and min(lags) == 0


def test_advantages_only_take_whole_prompt_groups() -> None:
    keys = [sample_key(i) for i in (0, 1, 2, 3, 4, 5, 8, 9, 10)]  # groups of 4: 0 complete, 1 and 2 partial
    assert complete_groups(keys, 4) == [sample_key(i) for i in (0, 1, 2, 3)]
    assert complete_groups(keys[6:], 4) == []


def test_staleness_metrics() -> None:
    m = staleness_metrics([3, 4, 4, 2], trained_version=4)
    assert m == {"staleness/min": 0.0, "staleness/mean": 0.75, "staleness/max": 2.0}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["mode.databus=kafka"], "mode.databus='kafka' is not one of"),
        (["mode.partial_rollout=drop"], "mode.partial_rollout='drop'"),
        (["mode.max_staleness=-1"], "mode.max_staleness must be >= 0"),
        (["weight_transfer.bucket_mb=0"], "weight_transfer.bucket_mb must be > 0"),
        (
            ["mode.deterministic=true", "algorithm.ppo_epochs=2"],
            "mode.deterministic=true needs one optimizer batch per rollout batch",
        ),
        (
            ["mode.deterministic=true", "algorithm.kl_loss_coef=0.1", "mode.ref_update_interval=2"],
            "mode.deterministic=true needs a frozen Reference (mode.ref_update_interval=0)",
        ),
    ],
)
def test_async_config_errors_name_the_key(tmp_path, overrides: list[str], message: str) -> None:
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    import relax_launch.cli  # noqa: F401  (registers the schema)
    from relax_core.errors import RelaxUserError
    from relax_core.preflight.validation import validate

    with initialize_config_module("relax_launch.conf", version_base="1.3"):
        cfg = OmegaConf.to_object(compose("config", overrides=["mode=async", *overrides]))
    with pytest.raises(RelaxUserError, match=re.escape(message)):
        validate(cfg)


@pytest.mark.parametrize(
    ("overrides", "cap"),
    [
        (["mode=async", "mode.max_staleness=2"], 2.0),  # stale samples: corrected by default
        (["mode=async", "mode.max_staleness=0"], None),  # on-policy: replays colocate exactly
        (["mode=async", "mode.max_staleness=1", "mode.off_policy_tis_cap=null"], None),
        (
            ["mode=async", "mode.max_staleness=1", "algorithm.tis_cap=1.5"],
            1.5,
        ),  # the algorithm's own cap wins
        ([], None),  # colocate
    ],
)
def test_off_policy_correction_is_on_whenever_samples_can_be_stale(overrides, cap) -> None:
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from relax_core.roles.actor import effective_algorithm
    from relax_launch.cli import CONFIG_MODULE

    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        cfg = OmegaConf.to_object(compose("config", overrides=overrides))
    assert effective_algorithm(cfg).tis_cap == cap
