"""The evaluation estimators against hand-computed cases (relax_core/evaluation/metrics.py)."""

from __future__ import annotations

from math import comb

import pytest

from relax_core.evaluation.metrics import answer_key, length_stats, maj_at_k, pass_at_k, sampled_metrics


def test_pass_at_k_hand_computed() -> None:
    # n=4, c=1: pass@1 = 1/4; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # n=5, c=2, k=3: 1 - C(3,3)/C(5,3) = 1 - 1/10
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)
    assert pass_at_k(8, 0, 8) == 0.0
    assert pass_at_k(8, 1, 8) == 1.0  # fewer wrong samples than k: some draw of k holds a right one
    assert pass_at_k(8, 3, 6) == 1.0


def test_pass_at_k_stable_where_binomials_overflow() -> None:
    # C(2000, 1000) is far past a float; the product form needs no binomial
    exact = 1 - comb(1990, 1000) / comb(2000, 1000)  # Python ints, then one division
    assert pass_at_k(2000, 10, 1000) == pytest.approx(exact, rel=1e-9)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_maj_at_k_votes_ties_and_blocks() -> None:
    ok = [True, False, False, True]
    # block [a, b, b, a]: 2-2 tie, "a" seen first wins -> correct
    assert maj_at_k(["a", "b", "b", "a"], ok, 4) == 1.0
    # blocks of 2: [a, b] tie -> a (correct), [b, a] tie -> b (wrong): mean 0.5
    assert maj_at_k(["a", "b", "b", "a"], ok, 2) == 0.5
    # no answer does not vote: the one answered "b" wins
    assert maj_at_k([None, None, "b", None], [False, False, False, False], 4) == 0.0
    assert maj_at_k([None, None], [True, True], 2) == 0.0
    # maj@1 is the share of correct samples
    assert maj_at_k(["x", "y", "x"], [True, False, True], 1) == pytest.approx(2 / 3)


def test_answer_keys() -> None:
    assert answer_key("  12  345\n", "text") == "12 345"
    assert answer_key("so \\boxed{42.0} then \\boxed{7}", "boxed") == "7"
    assert answer_key("no box", "boxed") is None
    assert answer_key("<think>1</think> it is 1,234.", "number") == "1234"
    with pytest.raises(ValueError):
        answer_key("x", "letters")


def test_sampled_metrics_and_lengths() -> None:
    groups = [
        ([True, False, False, False], [1.0, 0.0, 0.0, 0.0], ["1", "2", "2", "3"]),
        ([False, False, False, False], [0.5, 0.5, 0.0, 0.0], ["2", "2", "2", "2"]),
    ]
    m = sampled_metrics(groups, [1, 4, 16])
    assert m["pass@1"] == pytest.approx((0.25 + 0.0) / 2)
    assert m["pass@4"] == pytest.approx((1.0 + 0.0) / 2)
    assert m["maj@4"] == 0.0  # "2" wins the first prompt's vote and is wrong
    assert "pass@16" not in m  # k > n is left out
    assert m["sampled_reward"] == pytest.approx(2.0 / 8)
    assert length_stats([2, 4, 9], "len") == {"len/mean": 5.0, "len/min": 2.0, "len/max": 9.0}
