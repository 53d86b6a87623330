"""Math-family rewards (math, deepscaler, dapo, dapo_strict_box, openr1mm) on realistic answers."""

from __future__ import annotations

import pytest

import relax_rewards
from relax_rewards._text import all_boxed, last_boxed
from relax_rewards.builtin.dapo import normalize_final_answer

math_reward = relax_rewards.get("math")


def test_last_boxed_keeps_nested_braces_and_takes_the_last_complete_box() -> None:
    text = r"First \boxed{1}, then \boxed{\frac{\sqrt{3}}{2}} and a cut-off \boxed{\frac{1}{"
    assert last_boxed(text) == r"\frac{\sqrt{3}}{2}"
    assert all_boxed(r"\boxed{a} x \fbox{b} \boxed 7.") == ["a", "b", "7"]
    assert last_boxed(r"\boxed{\{1,2\}}") == r"\{1,2\}"
    assert last_boxed("no box here") is None


@pytest.mark.parametrize(
    ("response", "label"),
    [
        (r"The area is $\boxed{\frac{\sqrt{3}}{2}}$.", r"\frac{\sqrt3}{2}"),
        (r"So $x = \boxed{\frac{1}{2}}$", "0.5"),
        (r"Therefore the probability is \boxed{0.25}.", r"\frac{1}{4}"),
        (r"\boxed{\dfrac{3}{4}}", r"\frac34"),
        (r"I first guessed \boxed{2}, but rechecking gives \boxed{3}.", "3"),
        (r"The discount is \boxed{50\%}.", "50"),
        (r"The discount is \boxed{50\%}.", "0.5"),
        (r"It is \boxed{12\text{ cm}} long.", "12"),
        (r"She pays \boxed{18 dollars}.", "18"),
        (r"She pays \boxed{\$1,250}.", "1250"),
        (r"The solution set is \boxed{(-\infty, 2]}.", r"(-\infty,2]"),
        (r"\boxed{[1, 3)}", "[1,3)"),
        (r"The roots are \boxed{\{3, 1, 2\}}.", r"\{1,2,3\}"),
        (r"\boxed{x = 5}", "5"),
        (r"\boxed{90^\circ}", "90"),
        ("<think>Let me compute 6*7.</think> The final answer is $42$.", "42"),
        (r"\boxed{7}", ["6", "7"]),
    ],
)
def test_math_accepts_equivalent_answers(response: str, label: object) -> None:
    assert math_reward(response, label) == 1.0


@pytest.mark.parametrize(
    ("response", "label"),
    [
        (r"The answer is \boxed{\frac{1}{3}}.", "0.33"),  # not equal at the verifier's precision
        (r"\boxed{(1, 3]}", "[1,3)"),  # open/closed ends differ
        (r"\boxed{\{1, 2\}}", r"\{1,2,3\}"),
        (r"I first guessed \boxed{3}, but rechecking gives \boxed{2}.", "3"),  # only the last box counts
        (r"\boxed{-5}", "5"),
        (r"\boxed{40\%}", "0.5"),
        ("<think>The answer might be 42.</think> I am not sure.", "42"),
        ("", "1"),
    ],
)
def test_math_rejects_wrong_answers(response: str, label: str) -> None:
    assert math_reward(response, label) == 0.0


def test_math_without_label_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="needs a label"):
        math_reward(r"\boxed{1}", None)


def test_deepscaler_requires_finished_thinking_and_a_box() -> None:
    ds = relax_rewards.get("deepscaler")
    good = r"<think>2+2 is 4</think> The answer is \boxed{4}."
    assert ds(good, "4") == 1.0
    assert ds(good, "5") == 0.0
    assert ds(r"<think>2+2 is \boxed{4}", "4") == 0.0  # thinking never closed
    assert ds(r"<think>it is \boxed{4}</think> so four.", "4") == 0.0  # box only inside the thinking
    assert ds("<think>ok</think> The answer is 4.", "4") == 0.0  # no box after </think>
    assert ds(r"<think>hmm</think> \boxed{\dfrac{1}{2}}", "0.5") == 1.0


@pytest.mark.parametrize(
    ("raw", "normalized"),
    [
        ("x = 42", "42"),
        (r"\$1,234", "1234"),
        (r"\text{5 cm}", "5"),
        ("10 meters", "10"),
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        (r"\frac12", r"\frac{1}{2}"),
        ("42.0", "42"),
        (r"90^\circ", "90"),
        ("$(1, 2)$", "(1,2)"),
    ],
)
def test_dapo_normalization(raw: str, normalized: str) -> None:
    assert normalize_final_answer(raw) == normalized


def test_dapo_scores_answer_line_plus_or_minus_one() -> None:
    dapo = relax_rewards.get("dapo")
    cot = "Let me work it out step by step. " * 5
    right = dapo(cot + "\nAnswer: $1,000$ dollars", "1000")
    assert right == {"score": 1.0, "acc": 1.0, "pred": "1000"}
    assert dapo(cot + "\nAnswer: x = 42", "42")["score"] == 1.0
    assert dapo(cot + "\nAnswer: \\text{17}", "17")["acc"] == 1.0
    wrong = dapo(cot + "\nAnswer: 41", "42")
    assert wrong == {"score": -1.0, "acc": 0.0, "pred": "41"}
    assert dapo(cot + "\nno final line", "42")["score"] == -1.0
    # the answer must be in the tail: a later long ramble pushes it out of the window
    assert dapo("Answer: 42\n" + "more words " * 60, "42")["score"] == -1.0


def test_dapo_strict_box_needs_a_box_at_the_end() -> None:
    strict = relax_rewards.get("dapo_strict_box")
    assert strict(r"... so the total is \boxed{1,000}", "1000")["score"] == 1.0
    assert strict("... so the total is\nAnswer: 1000", "1000")["score"] == -1.0
    assert strict(r"\boxed{999}", "1000") == {"score": -1.0, "acc": 0.0, "pred": "999"}


def test_openr1mm_scores_one_or_zero_and_rejects_repeated_tags() -> None:
    r1 = relax_rewards.get("openr1mm")
    ok = "<think>There are 3 red and 4 blue.</think>\n<answer>7</answer>"
    assert r1(ok, "7") == {"score": 1.0, "acc": 1.0, "format": 1.0}
    assert r1(ok, "8") == {"score": 0.0, "acc": 0.0, "format": 1.0}
    no_format = "There are 7 cars. <answer>7</answer>"
    assert r1(no_format, "7") == {"score": 1.0, "acc": 1.0, "format": 0.0}
    trailing = "<think>a</think><answer>7</answer> extra"
    assert r1(trailing, "7")["format"] == 0.0
    for repeated in [
        "<think>a</think><think>b</think><answer>7</answer>",
        "<think>a</think><answer>3</answer><answer>7</answer>",
        "<think>a</think><answer>7</answer></answer>",
    ]:
        assert r1(repeated, "7") == {"score": 0.0, "acc": 0.0, "format": 0.0}, repeated
    # math equivalence and free-text fallback
    assert r1(r"<think>x</think><answer>\frac{1}{2}</answer>", "0.5")["acc"] == 1.0
    assert r1("<think>x</think><answer>A red car.</answer>", "a red car")["acc"] == 1.0
    assert r1("<think>x</think><answer>a blue car</answer>", "a red car")["acc"] == 0.0
    # the format bonus is opt-in
    assert r1(ok, "7", format_weight=0.5)["score"] == 1.5
    assert r1(ok, "8", format_weight=0.5)["score"] == 0.5


@pytest.mark.parametrize(
    ("pred", "gold"),
    [
        ("42", "42"),
        ("42", "43"),
        ("-7", "7"),
        ("0.25", r"\frac{1}{4}"),
        ("3/4", r"\dfrac{3}{4}"),
        (r"\frac34", "0.75"),
        (r"\frac{2}{4}", r"\frac{1}{2}"),
        ("0.333333", r"\frac{1}{3}"),
        ("0.33", r"\frac{1}{3}"),
        ("1.5", "1.50"),
        ("2", "2.0000001"),
        (r"-\frac{1}{2}", "-0.5"),
    ],
)
def test_plain_number_shortcut_agrees_with_math_verify(pred: str, gold: str) -> None:
    from relax_rewards._mathverify import _parse, _verify, answers_equal

    assert answers_equal(pred, gold) == _verify(_parse(gold), _parse(pred))
