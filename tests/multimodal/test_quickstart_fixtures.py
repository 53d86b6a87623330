"""The shipped quick-start fixtures (tests/fixtures/quickstart) load with their recipes' column mappings and
score with the rewards those recipes use: DAPO-Math-17k (chat-message prompts, nested ground truth),
Open-R1 multimodal (image column, no markers in the text) and AVQA (audio + image, lettered choices)."""

from __future__ import annotations

from pathlib import Path

import relax_rewards
from relax_core.config.schema import DataConfig, ModalityConfig
from relax_core.data.multimodal import MediaPrompts
from relax_core.data.prompts import load_prompts
from relax_models.loader import load_tokenizer
from relax_models.tokenizer import build_char_tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "quickstart"
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


def test_dapo_math_rows_load_with_nested_ground_truth_and_chat_template() -> None:
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    cfg = DataConfig(
        prompt_key="prompt",
        label_key="reward_model.ground_truth",
        metadata_key=None,
        max_prompt_len=4096,
        synthetic=None,
    )
    records, skipped = load_prompts(str(FIXTURES / "dapo_math_17k.jsonl"), cfg, tokenizer)
    assert skipped == 0 and [r.label for r in records] == ["49", "9", "19"]
    assert records[0].prompt_text.startswith("<user>Solve") and records[0].prompt_text.endswith("<assistant>")
    dapo = relax_rewards.get("dapo")
    assert dapo("x = 7, so x^2 = 49.\nAnswer: 49", records[0].label)["score"] == 1.0
    assert dapo("x^2 = 36\nAnswer: 36", records[0].label)["score"] == -1.0


def test_openr1_rows_get_their_image_before_the_question(twins) -> None:
    path = twins["qwen3_vl"]["path"]
    media = MediaPrompts.from_config(ModalityConfig(name="vision", keys={"image": "images"}), path)
    cfg = DataConfig(
        prompt_key="problem",
        label_key="solution",
        metadata_key=None,
        synthetic=None,
        max_prompt_len=4096,
        system_prompt="Think, then answer inside <answer></answer>.",
    )
    records, _ = load_prompts(str(FIXTURES / "openr1_mm.jsonl"), cfg, load_tokenizer(path), media)
    assert [r.label for r in records] == ["<answer>3</answer>", "<answer>2</answer>"]
    for record in records:
        assert record.prompt_text.index("<image>") < record.prompt_text.index("How many")
        assert Path(record.media["image"][0]).is_file()
    tensors = media.materialize(records[:1])[0].multimodal_inputs
    assert tensors["pixel_values"].shape[0] > 0 and tensors["image_grid_thw"].shape == (1, 3)
    score = relax_rewards.get("openr1mm")
    right = score("<think>three round shapes</think><answer>3</answer>", records[0].label)
    wrong = score("<think>two</think><answer>2</answer>", records[0].label)
    assert right["acc"] == 1.0 and wrong["acc"] == 0.0


def test_avqa_rows_carry_audio_and_image_and_score_by_letter(twins) -> None:
    path = twins["qwen3_omni"]["path"]
    media = MediaPrompts.from_config(
        ModalityConfig(name="omni", keys={"image": "images", "audio": "audios"}), path
    )
    cfg = DataConfig(
        prompt_key="question",
        label_key="answer",
        metadata_key="metadata",
        synthetic=None,
        max_prompt_len=4096,
    )
    records, _ = load_prompts(str(FIXTURES / "avqa.jsonl"), cfg, load_tokenizer(path), media)
    assert [r.label for r in records] == ["A", "B"] and len(records[0].metadata["choices"]) == 4
    tensors = media.materialize(records)[1].multimodal_inputs
    assert {"pixel_values", "input_features"} <= set(tensors)
    choice = relax_rewards.get("multiple_choice")
    assert choice("It is a high whistle, so the answer is (B).", "B", records[1].metadata) == 1.0
    assert choice("The answer is A.", "B", records[1].metadata) == 0.0
