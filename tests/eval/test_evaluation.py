"""Named eval sets on a real rollout role (tiny model, in-process): config checks, metrics of every set,
sampled evaluation on its own seed, and the metrics reaching every sink."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from relax_core.data.prompts import generate_synthetic, load_prompts
from relax_core.engines.base import SamplingParams
from relax_core.errors import RelaxUserError
from relax_core.evaluation.evaluator import Evaluator, eval_sets
from relax_core.roles.rollout import Rollout
from relax_core.telemetry.metrics import MetricsSink


def test_default_config_has_the_heldout_set_with_pass_at_8(make_cfg) -> None:
    sets = eval_sets(make_cfg())
    assert list(sets) == ["heldout"]
    assert (sets["heldout"].path, sets["heldout"].n_samples, sets["heldout"].k) == (None, 8, [1, 8])


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("+eval.sets.extra={n_sample: 4}", "eval.sets.extra.n_sample"),
        ("+eval.sets.extra={n_samples: 4, k: [8]}", "eval.sets.extra.k"),
        ("+eval.sets.extra={every: 30}", "eval.sets.extra.every=30"),
        ("+eval.sets.extra={answer: letters}", "eval.sets.extra.answer"),
        ("eval.primary=nope", "eval.primary='nope'"),
    ],
)
def test_a_bad_eval_set_is_one_line_naming_the_key(make_cfg, override: str, named: str) -> None:
    with pytest.raises(RelaxUserError) as err:
        eval_sets(make_cfg(override))
    assert str(err.value).startswith(named) and "\n" not in str(err.value)


@pytest.fixture
def rollout(make_cfg, tiny_model_dir: Path):
    role = Rollout(make_cfg("rollout.max_new_tokens=5"), str(tiny_model_dir))
    yield role
    role.shutdown()


def test_seeded_evaluation_leaves_the_training_draws_as_they_were(rollout, make_cfg, tmp_path) -> None:
    cfg = make_cfg()
    train_path, _ = generate_synthetic(cfg.data, tmp_path / "data", seed=3)
    prompts = load_prompts(train_path, cfg.data, rollout.tokenizer)[0][:4]
    start = rollout.rng_state()
    plain = [s.response_ids for s in rollout.generate(prompts) + rollout.generate(prompts)]
    rollout.set_rng_state(start)
    first = rollout.generate(prompts)
    sampling = SamplingParams(max_new_tokens=5, n=3, seed=11)
    eval_a = rollout.generate(prompts, False, sampling)
    eval_b = rollout.generate(prompts, False, sampling)
    second = rollout.generate(prompts)
    assert [s.response_ids for s in first + second] == plain  # training draws untouched by the eval
    assert len(eval_a) == 12 and [s.response_ids for s in eval_a] == [s.response_ids for s in eval_b]


def test_every_set_reports_and_reaches_jsonl_mlflow_tensorboard_and_plot(make_cfg, rollout, tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = make_cfg(
        "trainer.total_steps=50",
        "logger.tensorboard=true",
        "+eval.sets.small={limit: 3, n_samples: 4, k: [1, 2, 4], sampled_every: 50, "
        "prompt_template: 'sort {prompt}', reward: {name: f1}, answer: number}",
    )
    _, eval_path = generate_synthetic(cfg.data, Path(cfg.output_dir) / "data", cfg.seed)
    evaluator = Evaluator(cfg, rollout.tokenizer, None, eval_path)
    assert [len(s.prompts) for s in evaluator.sets.values()] == [6, 3]
    assert evaluator.sets["small"].prompts[0].prompt_text.startswith("sort sort ")
    start = evaluator.run(rollout.generate, 0)
    mid = evaluator.run(rollout.generate, 25)
    for key in (
        "eval/accuracy",
        "eval/heldout/pass@8",
        "eval/heldout/maj@8",
        "eval/small/pass@4",
        "eval/small/maj@2",
    ):
        assert 0.0 <= start[key] <= 1.0, key
    assert start["eval/accuracy"] == start["eval/heldout/accuracy"]
    assert start["eval/heldout/pass@1"] <= start["eval/heldout/pass@8"]
    assert "eval/heldout/response_len/mean" in start and "eval/small/sampled_len/max" in start
    assert start["eval/weight_version_min"] == start["eval/weight_version_max"] == 0
    assert "eval/heldout/pass@8" not in mid and "eval/small/pass@4" not in mid  # sampled: 0, 50 only
    assert evaluator.due(25) and evaluator.run(rollout.generate, 50)["eval/small/pass@4"] >= 0.0
    evaluator.close()

    sink = MetricsSink(cfg, OmegaConf.to_container(OmegaConf.structured(cfg)))
    sink.log(0, start)
    sink.log(25, {"reward/mean": 0.5, "reward/std": 0.1} | mid)
    sink.finish({"status": "finished"})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["eval/small/pass@4"] == start["eval/small/pass@4"]
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert events.Scalars("eval/small/pass@4")[0].value == pytest.approx(start["eval/small/pass@4"])
    from relax_core.telemetry.metrics import mlflow_client

    client = mlflow_client(sink.mlflow.uri)
    run_id = client.search_runs([client.get_experiment_by_name(cfg.logger.experiment_name).experiment_id])[0]
    history = client.get_metric_history(run_id.info.run_id, "eval/heldout/pass_8")
    assert [m.value for m in history] == [start["eval/heldout/pass@8"]]
    assert set(sink.set_points()) >= {("small", "accuracy"), ("heldout", "pass@8"), ("small", "maj@4")}
    assert (tmp_path / "reward_curve.png").stat().st_size > 0
