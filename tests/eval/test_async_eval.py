"""mode=async: an evaluation due for step e runs on version e alone, so newer weights wait for it."""

from __future__ import annotations

from relax_core.algorithms.spec import requirements
from relax_core.data.prompts import PromptStream
from relax_core.modes.asynchronous import AsyncMode, Schedule
from relax_core.modes.base import RunContext


def test_weights_newer_than_a_due_evaluation_wait_for_it(make_cfg, tiny_model_dir) -> None:
    cfg = make_cfg("mode=async", "mode.max_staleness=1")
    mode = AsyncMode(
        RunContext(cfg, str(tiny_model_dir), None, PromptStream([], cfg.seed), requirements(cfg))
    )
    st = Schedule(stages=[], trained=2)
    st.evals_due.add(2)  # step 2 trained, its evaluation not run yet
    assert mode._may_publish(st, 2)  # the evaluated version itself goes out
    assert not mode._may_publish(st, 3)  # step 3's weights would mix into (or replace) step 2's eval
    st.evals_due.discard(2)
    assert mode._may_publish(st, 3)
