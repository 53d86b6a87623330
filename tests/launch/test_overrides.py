"""In-process checks of bad overrides: the one-line message names the key (the CLI prints it)."""

from __future__ import annotations

import pytest

import relax_launch.cli


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["trainer.foo=1"], "trainer.foo"),
        (["trainer.lr=abc"], "trainer.lr"),
        (["algorithm=nope"], "algorithm"),
        (["+trainer.x=1"], "trainer.x"),
        (["rollout.batch_size=1.5"], "rollout.batch_size"),
        (["+model.tiny.nope=3"], "model.tiny.nope"),
    ],
)
def test_composition_problem_names_the_key(overrides: list[str], key: str) -> None:
    problem = relax_launch.cli.composition_problem(overrides)
    assert problem is not None and key in problem and "\n" not in problem


def test_composition_problem_is_none_for_good_overrides() -> None:
    assert relax_launch.cli.composition_problem(["algorithm=gspo", "trainer.lr=0.01", "seed=3"]) is None
