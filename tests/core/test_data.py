"""Prompt datasets: synthetic generation, JSONL/Parquet through one loader, malformed rows, PromptStream."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from relax_core.config.schema import DataConfig
from relax_core.data.prompts import PromptStream, dataset_paths, generate_synthetic, load_prompts
from relax_core.errors import RelaxUserError
from relax_core.samples import PromptRecord

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def chat_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def cfg(**kw) -> DataConfig:
    return replace(DataConfig(synthetic=None), **kw)


ROWS = [
    {"prompt": "sort 321:", "label": "123", "metadata": {"task": "sort", "k": 1}},
    {"prompt": "sort 90:", "label": "09", "metadata": {"task": "sort", "k": 2}},
    {"prompt": "sort 5:", "label": "5", "metadata": None},
]


# ---------------------------------------------------------------- synthetic task
def test_synthetic_eval_prompts_never_in_train(tmp_path: Path) -> None:
    data = DataConfig(num_train=300, num_eval=40, min_digits=2, max_digits=3)
    train_path, eval_path = generate_synthetic(data, tmp_path, seed=5)
    train = [json.loads(line) for line in Path(train_path).read_text().splitlines()]
    evals = [json.loads(line) for line in Path(eval_path).read_text().splitlines()]
    assert len(evals) == 40 and len({r["prompt"] for r in evals}) == 40
    # 2-3 digits: only 1100 distinct prompts, so many train draws collide with eval ones and are dropped
    assert len(train) == 300
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals}
    for row in train + evals:
        digits = row["prompt"].removeprefix("sort ").removesuffix(":")
        assert 2 <= len(digits) <= 3 and row["label"] == "".join(sorted(digits))
    # one seed, one dataset
    again = generate_synthetic(data, tmp_path / "again", seed=5)
    assert Path(again[0]).read_text() == Path(train_path).read_text()
    assert Path(again[1]).read_text() == Path(eval_path).read_text()
    other = generate_synthetic(data, tmp_path / "other", seed=6)
    assert Path(other[0]).read_text() != Path(train_path).read_text()


def test_unknown_synthetic_task_and_no_dataset_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(RelaxUserError, match="data.synthetic='nope'"):
        generate_synthetic(DataConfig(synthetic="nope"), tmp_path, seed=1)
    with pytest.raises(RelaxUserError, match="data.train_path"):
        dataset_paths(DataConfig(synthetic=None), str(tmp_path), seed=1)
    given = dataset_paths(cfg(train_path="/x/train.jsonl", eval_path="/x/eval.jsonl"), str(tmp_path), 1)
    assert given == ("/x/train.jsonl", "/x/eval.jsonl")
    generated = dataset_paths(DataConfig(num_train=10, num_eval=4), str(tmp_path), seed=1)
    assert all(Path(p).is_file() and Path(p).parent == tmp_path / "data" for p in generated)


# ---------------------------------------------------------------- one loader for JSONL and Parquet
def test_jsonl_and_parquet_load_to_the_same_records(tmp_path: Path, tokenizer) -> None:
    jsonl = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    parquet = tmp_path / "rows.parquet"
    pd.DataFrame(ROWS).to_parquet(parquet)
    from_jsonl, skipped_j = load_prompts(str(jsonl), cfg(), tokenizer)
    from_parquet, skipped_p = load_prompts(str(parquet), cfg(), tokenizer)
    assert skipped_j == skipped_p == 0
    assert len(from_jsonl) == 3

    def key(r: PromptRecord):
        return (r.index, r.prompt_ids, r.prompt_text, r.label, r.metadata)

    assert [key(r) for r in from_jsonl] == [key(r) for r in from_parquet]
    first = from_jsonl[0]
    assert first.prompt_text == "sort 321:"  # no chat template: the raw text
    assert first.prompt_ids == tokenizer("sort 321:", add_special_tokens=False).input_ids
    assert first.label == "123" and first.metadata["task"] == "sort"
    assert from_jsonl[2].metadata == {}  # null metadata -> empty


def test_nested_dotted_keys(tmp_path: Path, tokenizer) -> None:
    rows = [
        {"question": {"text": "sort 21:"}, "reward_model": {"ground_truth": "12", "style": "rule"}},
        {"question": {"text": "sort 3:"}, "reward_model": {"ground_truth": "3", "style": "rule"}},
    ]
    path = write_jsonl(tmp_path / "nested.jsonl", rows)
    data = cfg(prompt_key="question.text", label_key="reward_model.ground_truth", metadata_key=None)
    records, _ = load_prompts(str(path), data, tokenizer)
    assert [(r.prompt_text, r.label) for r in records] == [("sort 21:", "12"), ("sort 3:", "3")]
    with pytest.raises(RelaxUserError, match=r"row 0: missing column 'truth'"):
        load_prompts(str(path), replace(data, label_key="reward_model.truth"), tokenizer)


def test_chat_messages_with_a_chat_template(tmp_path: Path, tokenizer, chat_tokenizer) -> None:
    messages = [{"role": "user", "content": "sort 42:"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": messages, "label": "24"}, ROWS[0]])
    records, _ = load_prompts(str(path), cfg(), chat_tokenizer)
    assert records[0].prompt_text == "<user>sort 42:\n<assistant>"
    assert records[1].prompt_text == "<user>sort 321:\n<assistant>"  # a string prompt becomes one user turn
    assert records[0].prompt_ids == tokenizer(records[0].prompt_text, add_special_tokens=False).input_ids
    with_system, _ = load_prompts(str(path), cfg(system_prompt="be brief"), chat_tokenizer)
    assert with_system[0].prompt_text == "<system>be brief\n<user>sort 42:\n<assistant>"
    raw, _ = load_prompts(str(path), cfg(apply_chat_template=False), chat_tokenizer)
    assert raw[0].prompt_text == "sort 42:"


# ---------------------------------------------------------------- malformed input
def test_bad_json_line_names_file_and_line(tmp_path: Path, tokenizer) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], '{"prompt": "sort 1:", "label": ', ROWS[1]])
    with pytest.raises(RelaxUserError, match=r"bad\.jsonl.*line 2: invalid JSON") as err:
        load_prompts(str(path), cfg(), tokenizer)
    assert "\n" not in str(err.value)


def test_a_json_line_that_is_not_an_object_names_file_and_line(tmp_path: Path, tokenizer) -> None:
    path = write_jsonl(tmp_path / "list.jsonl", [ROWS[0], '["sort 1:", "1"]'])
    with pytest.raises(RelaxUserError, match=r"list\.jsonl.*line 2: a row must be a JSON object"):
        load_prompts(str(path), cfg(), tokenizer)


def test_missing_prompt_column_names_file_and_row(tmp_path: Path, tokenizer) -> None:
    path = write_jsonl(tmp_path / "cols.jsonl", [ROWS[0], {"question": "sort 7:", "label": "7"}, ROWS[1]])
    with pytest.raises(RelaxUserError, match=r"cols\.jsonl.*row 1: missing column 'prompt'") as err:
        load_prompts(str(path), cfg(), tokenizer)
    assert "on_error=skip" in str(err.value)


def test_on_error_skip_drops_and_counts_malformed_rows(tmp_path: Path, tokenizer) -> None:
    rows = [
        ROWS[0],
        {"question": "sort 7:", "label": "7"},  # missing prompt column
        {"prompt": 42, "label": "x"},  # neither text nor messages
        {"prompt": "", "label": "x"},  # empty
        {"prompt": "sort " + "9" * 50 + ":", "label": "x"},  # longer than max_prompt_len
        {"prompt": "sort 1:", "label": "1", "metadata": "not an object"},
        ROWS[1],
    ]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    records, skipped = load_prompts(str(path), cfg(on_error="skip", max_prompt_len=32), tokenizer)
    assert skipped == 5
    assert [r.index for r in records] == [0, 6]
    for bad, reason in [(2, "string or a list"), (3, "empty"), (4, "max_prompt_len=32"), (5, "object")]:
        only = write_jsonl(tmp_path / f"bad{bad}.jsonl", [ROWS[0], rows[bad]])
        with pytest.raises(RelaxUserError, match=rf"row 1: .*{reason}"):
            load_prompts(str(only), cfg(max_prompt_len=32), tokenizer)
    all_bad = write_jsonl(tmp_path / "all_bad.jsonl", rows[1:4])
    with pytest.raises(RelaxUserError, match=r"every row was malformed \(3 skipped\)"):
        load_prompts(str(all_bad), cfg(on_error="skip"), tokenizer)


def test_bad_bytes_and_bad_json_lines_name_the_line_and_are_skipped_under_skip(
    tmp_path: Path, tokenizer
) -> None:
    path = tmp_path / "bytes.jsonl"
    good = [json.dumps(r).encode() for r in ROWS[:2]]
    path.write_bytes(
        b"\n".join([good[0], b'{"prompt": "sort \xff3:", "label": "3"}', b'{"prompt": ', good[1], b""])
    )
    with pytest.raises(RelaxUserError, match=r"bytes\.jsonl.*line 2: not UTF-8.*on_error=skip") as err:
        load_prompts(str(path), cfg(), tokenizer)
    assert "\n" not in str(err.value)
    records, skipped = load_prompts(str(path), cfg(on_error="skip"), tokenizer)
    assert skipped == 2  # the bad bytes and the invalid JSON line, like any other bad row
    assert [r.prompt_text for r in records] == [ROWS[0]["prompt"], ROWS[1]["prompt"]]


@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_empty_jsonl_file(tmp_path: Path, tokenizer, content: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(RelaxUserError, match=r"empty\.jsonl' has no rows"):
        load_prompts(str(path), cfg(), tokenizer)


def test_missing_unsupported_and_unreadable_files(tmp_path: Path, tokenizer) -> None:
    with pytest.raises(RelaxUserError, match="does not exist"):
        load_prompts(str(tmp_path / "nope.jsonl"), cfg(), tokenizer)
    csv = tmp_path / "rows.csv"
    csv.write_text("prompt,label\nsort 1:,1\n")
    with pytest.raises(RelaxUserError, match="unsupported format '.csv'"):
        load_prompts(str(csv), cfg(), tokenizer)
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"definitely not parquet")
    with pytest.raises(RelaxUserError, match=r"broken\.parquet' cannot be read") as err:
        load_prompts(str(broken), cfg(), tokenizer)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- PromptStream
def records(n: int) -> list[PromptRecord]:
    return [PromptRecord(index=i, prompt_ids=[i + 3], prompt_text=str(i)) for i in range(n)]


def test_prompt_stream_epochs_cover_every_record_once() -> None:
    stream = PromptStream(records(10), seed=3)
    first = [r.index for r in stream.next_batch(4) + stream.next_batch(6)]
    assert sorted(first) == list(range(10)) and first != list(range(10))
    assert stream.state_dict() == {"epoch": 0, "position": 10}
    second = [r.index for r in stream.next_batch(10)]
    assert sorted(second) == list(range(10)) and second != first  # a fresh shuffle per epoch
    assert stream.state_dict() == {"epoch": 1, "position": 10}
    # a batch may straddle an epoch boundary
    straddle = PromptStream(records(3), seed=3)
    batch = [r.index for r in straddle.next_batch(5)]
    assert sorted(batch[:3]) == [0, 1, 2] and straddle.state_dict() == {"epoch": 1, "position": 2}
    ordered = PromptStream(records(4), seed=3, shuffle=False)
    assert [r.index for r in ordered.next_batch(6)] == [0, 1, 2, 3, 0, 1]
    # the order depends on the seed, and only on the seed
    assert [r.index for r in PromptStream(records(10), seed=3).next_batch(10)] == first
    assert [r.index for r in PromptStream(records(10), seed=4).next_batch(10)] != first


def test_prompt_stream_state_dict_round_trip() -> None:
    stream = PromptStream(records(7), seed=11)
    stream.next_batch(5)
    stream.next_batch(5)  # into epoch 1
    state = stream.state_dict()
    restored = PromptStream(records(7), seed=11)
    restored.load_state_dict(json.loads(json.dumps(state)))  # survives serialisation
    expected = [r.index for r in stream.next_batch(12)]
    assert [r.index for r in restored.next_batch(12)] == expected
