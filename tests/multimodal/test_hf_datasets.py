"""Hugging Face datasets as ``data.train_path``: save_to_disk folders, Parquet files and globs, a dataset name in
the local HF cache, splits; rows read lazily from memory-mapped Arrow; ``Image``/``Audio`` columns of bytes
reaching the processors as the synthetic tasks' media files do; one user error per cause; one in-process run."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import datasets
import launching
import pytest
import torch
from datasets import Audio, Features, Image

import relax_core.data.prompts
from relax_core.config.schema import DataConfig
from relax_core.data.multimodal import MediaPrompts
from relax_core.data.prompts import PromptRows, PromptStream, load_prompts, read_rows
from relax_core.errors import RelaxUserError
from relax_core.samples import PromptRecord
from relax_models.loader import load_tokenizer

datasets.disable_progress_bars()


@pytest.fixture(autouse=True)
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Parquet/JSON conversions go to a cache of the test's own, not the user's ~/.cache/huggingface."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    return tmp_path / "hf_cache"


def _jsonl(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _hf_rows(jsonl: str, column: str) -> dict[str, list]:
    """A synthetic task's rows as columns, its media files' bytes in ``column`` (an Image or Audio column)."""
    rows, folder = _jsonl(jsonl), Path(jsonl).parent
    media_key = "images" if column == "image" else "audios"
    return {
        "prompt": [r["prompt"] for r in rows],
        "label": [r["label"] for r in rows],
        "metadata": [r["metadata"] for r in rows],
        column: [{"bytes": (folder / r[media_key][0]).read_bytes(), "path": None} for r in rows],
    }


def _dataset(jsonl: str, column: str) -> datasets.Dataset:
    feature = Image() if column == "image" else Audio()
    plain = datasets.Dataset.from_dict(_hf_rows(jsonl, column))
    # cast, not features=...: encoding an Audio value needs torchcodec, casting its {"bytes", "path"} does not
    return plain.cast(Features({**plain.features, column: feature}))


@pytest.fixture(scope="module")
def hf(twins, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Per family, the synthetic task as HF datasets: a save_to_disk DatasetDict (train/test) and Parquet."""
    root = tmp_path_factory.mktemp("hf_datasets")
    out = {}
    for family, column in (("qwen3_vl", "image"), ("qwen3_omni", "audio")):
        t = twins[family]
        train, test = _dataset(t["train"], column), _dataset(t["eval"], column)
        folder = root / family / "disk"
        datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(folder))
        train.to_parquet(str(root / family / "train.parquet"))
        out[family] = {"disk": str(folder), "parquet": str(root / family / "train.parquet"), "column": column}
    return out


def _setup(twins, family: str, column: str | None = None):
    t = twins[family]
    modality = t["modality"]
    if column is not None:
        modality = dataclasses.replace(modality, keys={k: column for k in modality.keys})
    return t, load_tokenizer(t["path"]), MediaPrompts.from_config(modality, t["path"])


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_omni"])
@pytest.mark.parametrize("source", ["disk", "parquet"])
def test_media_bytes_reach_the_processor_as_the_files_do(twins, hf, family: str, source: str) -> None:
    t, tokenizer, from_files = _setup(twins, family)
    _, _, from_column = _setup(twins, family, hf[family]["column"])
    expected, _ = load_prompts(t["train"], t["data"], tokenizer, from_files)
    records, skipped = load_prompts(hf[family][source], t["data"], tokenizer, from_column, lazy=True)
    assert isinstance(records, PromptRows) and skipped == 0 and len(records) == len(expected) == 48
    # memory-mapped Arrow (the save_to_disk files or the HF cache's conversion of the Parquet), not a list
    assert records.rows.dataset.cache_files
    for i in (0, 7, 47):
        record, reference = records[i], expected[i]
        (item,) = next(iter(record.media.values()))
        assert set(item) == {"bytes", "path"} and item["bytes"][:4] in (b"\x89PNG", b"RIFF")
        assert record.prompt_ids == reference.prompt_ids and record.label == reference.label
        assert record.metadata == reference.metadata
        (got,), (want,) = from_column.materialize([record]), from_files.materialize([reference])
        assert got.multimodal_inputs.keys() == want.multimodal_inputs.keys()
        for key, tensor in want.multimodal_inputs.items():
            assert torch.equal(got.multimodal_inputs[key], tensor), key


def test_splits_eval_sets_and_the_stream(twins, hf) -> None:
    t, tokenizer, from_files = _setup(twins, "qwen3_vl")
    _, _, media = _setup(twins, "qwen3_vl", "image")
    folder = hf["qwen3_vl"]["disk"]
    train, _ = load_prompts(folder, t["data"], tokenizer, media, lazy=True)  # data.split: train
    test, _ = load_prompts(folder, t["data"], tokenizer, media, split="test", limit=5)
    assert len(train) == 48 and isinstance(test, list) and len(test) == 5
    expected = load_prompts(t["eval"], t["data"], tokenizer, from_files, limit=5)[0]
    assert [r.prompt_ids for r in test] == [r.prompt_ids for r in expected]
    with pytest.raises(RelaxUserError, match=r"has no split 'validation': choose one of train, test"):
        load_prompts(folder, t["data"], tokenizer, media, split="validation")
    stream = PromptStream(train, seed=1)
    drawn = [r.index for _ in range(4) for r in stream.next_batch(16)]
    # an epoch covers every row once, then the next one starts
    assert sorted(drawn[:48]) == list(range(48)) and len(set(drawn[48:])) == 16


def test_a_missing_column_a_bad_row_and_a_missing_path_are_one_user_error(twins, hf, tmp_path: Path) -> None:
    t, tokenizer, media = _setup(twins, "qwen3_vl", "image")
    folder = hf["qwen3_vl"]["disk"]
    with pytest.raises(
        RelaxUserError, match=r"has no column 'question' \(data.prompt_key='question'\); its "
    ):
        load_prompts(
            folder, dataclasses.replace(t["data"], prompt_key="question"), tokenizer, media, lazy=True
        )
    _, _, wrong_media = _setup(twins, "qwen3_vl", "picture")
    with pytest.raises(RelaxUserError, match=r"no column 'picture' \(modality.keys.image='picture'\)"):
        load_prompts(folder, t["data"], tokenizer, wrong_media, lazy=True)
    # rows 1 and 3 without a prompt: named when drawn, or skipped and counted under on_error=skip
    rows = _hf_rows(t["train"], "image")
    rows["prompt"][1] = rows["prompt"][3] = None
    bad = tmp_path / "bad.parquet"
    datasets.Dataset.from_dict(rows).cast_column("image", Image()).to_parquet(str(bad))
    prompts, _ = load_prompts(str(bad), t["data"], tokenizer, media, lazy=True)
    with pytest.raises(RelaxUserError, match=r"bad\.parquet', row 1: missing column 'prompt'"):
        prompts[1]
    skip = dataclasses.replace(t["data"], on_error="skip")
    prompts, _ = load_prompts(str(bad), skip, tokenizer, media, lazy=True)
    stream = PromptStream(prompts, seed=1, shuffle=False)
    assert [r.index for r in stream.next_batch(5)] == [0, 2, 4, 5, 6] and prompts.skipped == 2
    for path, message in [
        (str(tmp_path / "nope.parquet"), "does not exist"),
        (str(tmp_path / "*.arrow"), "matches no file"),
        ("relax-tests/not-cached", "nor a dataset in the local Hugging Face cache"),
    ]:
        with pytest.raises(RelaxUserError, match=message):
            load_prompts(path, t["data"], tokenizer, media)


def test_the_stream_passes_over_skipped_rows_and_stops_when_none_is_left() -> None:
    one = PromptRecord(index=3, prompt_ids=[5], prompt_text="x")
    stream = PromptStream([None, None, None, one, None], seed=2)  # None: a row PromptRows skipped
    assert [r.index for r in stream.next_batch(7)] == [3] * 7
    with pytest.raises(RelaxUserError, match="every row of the training set is malformed"):
        PromptStream([None] * 4, seed=2).next_batch(1)


def test_a_dataset_name_in_the_local_cache_is_read_offline(
    twins, hf, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t, tokenizer, media = _setup(twins, "qwen3_vl", "image")
    # the files a hub download of "relax-tests/tiny_colors" leaves in the cache:
    # <cache>/<namespace>___<name>/<config>/<version>/<hash>/<name>-<split>.arrow and dataset_info.json
    built = datasets.load_dataset("parquet", data_files=hf["qwen3_vl"]["parquet"], cache_dir=str(tmp_path))
    (arrow,) = (Path(f["filename"]) for f in built["train"].cache_files)
    entry = tmp_path / "relax-tests___tiny_colors" / "default" / arrow.parent.parent.name / arrow.parent.name
    entry.parent.mkdir(parents=True)
    arrow.parent.rename(entry)
    (entry / arrow.name).rename(entry / "tiny_colors-train.arrow")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)  # Relax reads offline regardless
    records, _ = load_prompts("relax-tests/tiny_colors", t["data"], tokenizer, media)
    expected, _ = load_prompts(hf["qwen3_vl"]["parquet"], t["data"], tokenizer, media)
    assert [r.prompt_ids for r in records] == [r.prompt_ids for r in expected]
    assert datasets.config.HF_HUB_OFFLINE is False  # put back


def test_text_parquet_shards_arrow_files_and_large_jsonl_give_the_records_of_jsonl(
    tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = [
        {"prompt": f"sort {n}:", "label": "".join(sorted(str(n))), "metadata": {"k": n}}
        for n in range(120, 130)
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for shard in range(2):
        datasets.Dataset.from_list(rows[shard * 5 : shard * 5 + 5]).to_parquet(
            str(tmp_path / f"train-{shard}.parquet")
        )
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "disk"))
    data = DataConfig(synthetic=None)
    jsonl, _ = load_prompts(str(tmp_path / "rows.jsonl"), data, tokenizer)
    key = [(r.index, r.prompt_ids, r.label, r.metadata) for r in jsonl]
    arrow = str(tmp_path / "disk" / "data-*.arrow")
    for path in (str(tmp_path / "train-*.parquet"), arrow):
        records, _ = load_prompts(path, data, tokenizer)
        assert [(r.index, r.prompt_ids, r.label, r.metadata) for r in records] == key, path
    # a JSON Lines file over the in-memory size goes through datasets too
    monkeypatch.setattr(relax_core.data.prompts, "JSONL_IN_MEMORY_BYTES", 0)
    records, _ = load_prompts(str(tmp_path / "rows.jsonl"), data, tokenizer, lazy=True)
    assert isinstance(records, PromptRows) and [records[i].prompt_ids for i in range(10)] == [
        r.prompt_ids for r in jsonl
    ]


def test_a_jsonl_file_does_not_import_datasets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``import datasets`` costs seconds; the default experiment and small JSON Lines files never pay them."""
    (tmp_path / "rows.jsonl").write_text('{"prompt": "sort 21:", "label": "12"}\n')
    monkeypatch.setitem(sys.modules, "datasets", None)  # any `import datasets` now raises ImportError
    rows, _, _ = read_rows(str(tmp_path / "rows.jsonl"), DataConfig(synthetic=None))
    assert rows == [{"prompt": "sort 21:", "label": "12"}]


@pytest.mark.slow
def test_an_in_process_vision_run_trains_on_a_saved_dataset(hf, tmp_path: Path, relax_launch_cmd) -> None:
    folder = hf["qwen3_vl"]["disk"]
    overrides = [
        "experiment=vision_colors_tiny_vl",
        "cluster=in_process",
        f"data.train_path={folder}",
        f"data.eval_path={folder}",
        "modality.keys.image=image",
        "trainer.total_steps=2",
        "trainer.sft_warmup_steps=1",
        "trainer.eval_every=2",
        "trainer.export_final_model=false",
        "rollout.batch_size=4",
        "rollout.n_samples_per_prompt=2",
        "eval.sets.heldout.n_samples=0",
        "+eval.sets.heldout.limit=4",
        "logger=jsonl",
    ]
    launching.launch(tmp_path / "run", *overrides, timeout=900, command=relax_launch_cmd)
    summary = launching.read_summary(tmp_path / "run")
    assert summary["status"] == "finished" and summary["steps"] == 2 and summary["skipped_rows"] == 0
    assert summary["eval_accuracy_final"] is not None
