"""Non-math rewards: multiple choice, F1, IFEval, digits, and the registry itself."""

from __future__ import annotations

import pytest

import relax_rewards
from relax_rewards.builtin.multiple_choice import extract_choice

gpqa = relax_rewards.get("gpqa")
mc = relax_rewards.get("multiple_choice")


@pytest.mark.parametrize(
    ("response", "letter"),
    [
        ("After weighing the options, the answer is (C).", "C"),
        ("Option A is wrong because of parity, and B ignores friction. Final Answer: D", "D"),
        ("<think>maybe A? no.</think><answer>B</answer>", "B"),
        ("The correct answer is B, since the ester hydrolyses first.", "B"),
        (r"Therefore $\boxed{\text{A}}$", "A"),
        ("Answer: (d)", None),  # lower-case outside a tag/box is not a letter we trust
        ("Actually, I need more information.", None),
        ("(A) fails, (B) fails, so (C).", "C"),
        ("C", "C"),
    ],
)
def test_extract_choice(response: str, letter: str | None) -> None:
    assert extract_choice(response, "ABCD") == letter


def test_gpqa_scores_letters_in_prose() -> None:
    assert gpqa("Comparing the spectra, the answer is (B).", "B") == 1.0
    assert gpqa("Comparing the spectra, the answer is (B).", "C") == 0.0
    assert gpqa("<think>It could be D.</think> Final answer: A", "A") == 1.0  # thinking ignored
    assert gpqa("The answer is E.", "A") == 0.0  # E is not a GPQA option
    # label given as the correct option's text, options listed in their shuffled order
    md = {"choices": ["1.5 eV", "3.0 eV", "4.5 eV", "6.0 eV"]}
    assert gpqa("so the answer is (C)", "4.5 eV", md) == 1.0
    assert gpqa("so the answer is (B)", "4.5 eV", md) == 0.0


def test_multiple_choice_valid_letters_from_metadata() -> None:
    five = {"choices": ["a", "b", "c", "d", "e"]}
    assert mc("I pick (E).", "E", five) == 1.0
    assert mc("I pick (E).", "A") == 0.0  # default letters are A-D: (E) is no answer
    with pytest.raises(ValueError, match="not one of the letters"):
        mc("I pick (E).", "E")
    assert mc("The answer is F", "F", {"valid_letters": "ABCDEF"}) == 1.0
    assert mc("The answer is (C)", 2) == 1.0  # 0-based index label
    with pytest.raises(ValueError, match="not one of the letters"):
        mc("The answer is (C)", "Z")


f1 = relax_rewards.get("f1")


def test_f1_partial_credit_and_exact_yes_no() -> None:
    out = f1("The Eiffel Tower in Paris", "Eiffel Tower")
    # tokens after normalisation: [eiffel, tower, in, paris] vs [eiffel, tower] -> P=1/2, R=1
    assert out["score"] == pytest.approx(2 / 3)
    assert (out["precision"], out["recall"], out["em"]) == (0.5, 1.0, 0.0)
    assert f1("<think>hmm</think><answer>the Eiffel tower!</answer>", "Eiffel Tower")["em"] == 1.0
    assert f1("Answer: Marie Curie", ["Curie", "Marie Curie"])["score"] == 1.0
    assert f1("yes it is", "yes")["score"] == 0.0  # yes/no must match exactly
    assert f1("Yes.", "yes")["score"] == 1.0
    assert f1("no", "yes")["score"] == 0.0
    assert f1("Berlin", "Paris")["score"] == 0.0


ifeval = relax_rewards.get("ifeval")


def _md(*pairs: tuple[str, dict]) -> dict:
    return {"instruction_id_list": [p[0] for p in pairs], "kwargs": [p[1] for p in pairs]}


@pytest.mark.parametrize(
    ("instruction", "kwargs", "good", "bad"),
    [
        (
            "length_constraints:number_words",
            {"relation": "less than", "num_words": 5},
            "Four words right here.",
            "This has six words in it.",
        ),
        (
            "length_constraints:number_words",
            {"relation": "at least", "num_words": 3},
            "one two three",
            "one two",
        ),
        (
            "length_constraints:number_sentences",
            {"relation": "at most", "num_sentences": 2},
            "One. Two!",
            "One. Two. Three?",
        ),
        (
            "length_constraints:number_paragraphs",
            {"num_paragraphs": 2},
            "First part.\n***\nSecond part.",
            "Only one.",
        ),
        (
            "keywords:existence",
            {"keywords": ["ocean", "salt"]},
            "The ocean tastes of salt.",
            "The ocean is blue.",
        ),
        ("keywords:forbidden_words", {"forbidden_words": ["very"]}, "It is quite big.", "It is Very big."),
        (
            "keywords:frequency",
            {"keyword": "rain", "frequency": 2, "relation": "at least"},
            "Rain, rain, go away.",
            "Rain stops.",
        ),
        ("detectable_format:json_format", {}, '```json\n{"a": 1}\n```', "{'a': 1}"),
        (
            "detectable_format:number_bullet_lists",
            {"num_bullets": 2},
            "* one\n* two",
            "* one\n* two\n* three",
        ),
        ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*a* and *b*", "*a* only"),
        ("detectable_format:title", {}, "<<My Poem>>\nRoses...", "My Poem\nRoses..."),
        (
            "detectable_content:number_placeholders",
            {"num_placeholders": 2},
            "Dear [name], at [address]",
            "Dear [name]",
        ),
        (
            "detectable_content:postscript",
            {"postscript_marker": "P.S."},
            "Bye.\nP.S. see you",
            "Bye. PS see you",
        ),
        ("change_case:english_lowercase", {}, "all quiet here", "All quiet here"),
        ("change_case:english_capital", {}, "ALL LOUD HERE", "ALL LOUD HERe"),
        (
            "change_case:capital_word_frequency",
            {"capital_frequency": 2, "capital_relation": "less than"},
            "I LOVE it",
            "I LOVE THIS SONG",
        ),
        ("startend:start_checker", {"start_phrase": "Dear team"}, "Dear team, hello.", "Hello, dear team."),
        (
            "startend:end_checker",
            {"end_phrase": "Any other questions?"},
            "Done. Any other questions?",
            "Any other questions? Done.",
        ),
        ("startend:quotation", {}, '"wrapped"', "not wrapped"),
        ("punctuation:no_comma", {}, "No commas here.", "Commas, here."),
    ],
)
def test_ifeval_each_instruction(instruction: str, kwargs: dict, good: str, bad: str) -> None:
    assert ifeval(good, None, _md((instruction, kwargs))) == {"score": 1.0, "partial": 1.0}
    assert ifeval(bad, None, _md((instruction, kwargs))) == {"score": 0.0, "partial": 0.0}


def test_ifeval_partial_and_errors() -> None:
    md = _md(
        ("punctuation:no_comma", {}),
        ("change_case:english_lowercase", {}),
        ("keywords:existence", {"keywords": ["cat"]}),
    )
    assert ifeval("<think>Plan, Then write.</think>a cat sat", None, md) == {"score": 1.0, "partial": 1.0}
    out = ifeval("A cat sat", None, md)
    assert out["score"] == 0.0 and out["partial"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="unsupported instruction id 'nope:x'"):
        ifeval("x", None, _md(("nope:x", {})))
    with pytest.raises(ValueError, match="instruction_id_list"):
        ifeval("x", None, {})
    with pytest.raises(ValueError, match="needs kwarg 'num_words'"):
        ifeval(
            "x", None, _md(("length_constraints:number_words", {"relation": "at least", "num_words": None}))
        )


digits = relax_rewards.get("digits")


@pytest.mark.parametrize(
    ("response", "label", "score", "acc"),
    [
        ("12345", "12345", 1.0, 1.0),
        ("  12345\n", "12345", 1.0, 1.0),
        ("12395", "12345", 4 / 5, 0.0),
        ("123", "12345", 3 / 5, 0.0),
        ("1234567", "12345", 5 / 7, 0.0),  # extra characters are penalised
        ("54321", "12345", 1 / 5, 0.0),
        ("", "12345", 0.0, 0.0),
    ],
)
def test_digits_contract(response: str, label: str, score: float, acc: float) -> None:
    out = digits(response, label)
    assert out["score"] == pytest.approx(score) and out["acc"] == acc


def test_registry_lists_and_rejects_unknown_names() -> None:
    names = relax_rewards.available()
    for name in [
        "math",
        "deepscaler",
        "dapo",
        "dapo_strict_box",
        "gpqa",
        "multiple_choice",
        "f1",
        "ifeval",
        "openr1mm",
        "genrm",
        "remote",
        "digits",
    ]:
        assert name in names
    with pytest.raises(KeyError, match="unknown reward 'mathh'; available rewards: .*math"):
        relax_rewards.get("mathh")
    assert relax_rewards.get_entry("digits").key == "score"


def test_register_custom_and_name_clash() -> None:
    @relax_rewards.register("test_text_length_reward")
    def length(response: str, label: object, metadata: dict | None = None) -> float:
        return float(len(response))

    assert relax_rewards.get("test_text_length_reward")("abc", None) == 3.0

    with pytest.raises(ValueError, match="already registered"):

        @relax_rewards.register("math")
        def other(response: str, label: object, metadata: dict | None = None) -> float:
            return 0.0
