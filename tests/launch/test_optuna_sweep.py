"""A hyperparameter search with Hydra's Optuna sweeper: three tiny points in one process, one of which
fails. The failed point is a failed trial, the others return their ``sweep_metric`` to Optuna, and the
points land in one MLflow parent run and one W&B group (offline)."""

from __future__ import annotations

import os
from pathlib import Path

import launching
import pytest
import yaml
from wandb_reader import wandb_records

from relax_core.errors import RelaxUserError
from relax_launch.sweep import sweep_group, sweep_objective, sweep_tracking_uri

TINY = [
    "cluster=in_process",
    "trainer.sft_warmup_steps=1",
    "trainer.sft_batch_size=8",
    "trainer.total_steps=2",
    "trainer.eval_every=0",
    "trainer.export_final_model=false",
    "rollout.batch_size=4",
    "rollout.n_samples_per_prompt=4",
    "data.num_train=32",
    "data.num_eval=4",
    "rollout.num_threads=1",
    "trainer.num_threads=1",
]


def test_sweep_objective_reads_summary_keys_then_step_metrics(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.25}\n')
    summary = {
        "status": "finished",
        "output_dir": str(tmp_path),
        "eval_accuracy_final": 0.75,
        "eval_sets_final": {"heldout": {"pass@4": 1.0}},
        "eval_accuracy_start": None,
    }
    assert sweep_objective(summary, "eval_accuracy_final") == 0.75
    assert sweep_objective(summary, "eval_sets_final.heldout.pass@4") == 1.0
    assert sweep_objective(summary, "loss") == 0.25  # the last logged value
    assert sweep_objective(summary, "eval_accuracy_start") is None  # no eval set: nothing to rank
    assert sweep_objective({"status": "preempted"}, "eval_accuracy_final") is None
    with pytest.raises(RelaxUserError, match="sweep_metric='los' is neither"):
        sweep_objective(summary, "los")
    with pytest.raises(RelaxUserError, match="is not a number but dict"):
        sweep_objective(summary, "eval_sets_final")


def test_a_failed_last_grid_point_ends_the_grid_not_the_sweep() -> None:
    """As hydra-optuna-sweeper tells Optuna a failed trial: on the grid's last point GridSampler stops the
    study, which raises outside Study.optimize (the sweep below drew that order one time in three)."""
    import optuna

    from relax_launch.sweep import let_failed_grid_points_end_the_grid

    def fail_the_only_point() -> None:
        study = optuna.create_study(sampler=optuna.samplers.GridSampler({"x": [1]}))
        trial = study.ask()
        trial.suggest_categorical("x", [1])
        study.tell(trial, state=optuna.trial.TrialState.FAIL)

    after_trial = optuna.samplers.GridSampler.after_trial
    try:
        with pytest.raises(RuntimeError, match="Study.stop"):
            fail_the_only_point()
        let_failed_grid_points_end_the_grid()
        fail_the_only_point()
    finally:
        optuna.samplers.GridSampler.after_trial = after_trial


@pytest.mark.slow
def test_optuna_search_survives_a_failed_point(tmp_path: Path, relax_launch_cmd: list[str]) -> None:
    sweep_dir = tmp_path / "sweep"
    # W&B offline and never logged in, whatever the caller's environment
    env = {k: None for k in os.environ if k.startswith("WANDB_")}
    env |= {"NETRC": str(tmp_path / "no.netrc"), "WANDB_CONFIG_DIR": str(tmp_path / "wandb_home")}
    launching.launch(
        None,
        "-m",
        f"hydra.sweep.dir={sweep_dir}",
        "hydra/sweeper=optuna",
        "hydra/sweeper/sampler=grid",  # every choice once
        "hydra.sweeper.direction=maximize",
        "hydra.sweeper.n_trials=3",
        "algorithm.advantage_estimator=choice(grpo,rloo,no_such_estimator)",
        "sweep_metric=entropy",  # a per-step metric whose last value the two estimators' updates part
        "logger=mlflow",
        "logger.wandb=true",
        *TINY,
        env=env,
        cwd=tmp_path,
        timeout=600,
        command=relax_launch_cmd,
    )

    points = {}
    for point in sorted(p for p in sweep_dir.iterdir() if p.name.isdigit()):
        overrides = yaml.safe_load((point / ".hydra" / "overrides.yaml").read_text())
        estimator = next(o.split("=")[1] for o in overrides if o.startswith("algorithm.advantage_estimator="))
        points[estimator] = point
    assert sorted(points) == ["grpo", "no_such_estimator", "rloo"]
    assert not (points["no_such_estimator"] / "summary.json").exists()
    assert (
        "failed: algorithm.advantage_estimator='no_such_estimator'"
        in (points["no_such_estimator"] / "cli.log").read_text()
    )

    # Optuna ranked the two finished points by their last entropy
    returned = {
        name: sweep_objective(yaml.safe_load((points[name] / "summary.json").read_text()), "entropy")
        for name in ("grpo", "rloo")
    }
    assert returned["grpo"] != returned["rloo"], returned
    best = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert best["best_value"] == max(returned.values())
    assert best["best_params"]["algorithm.advantage_estimator"] == max(returned, key=returned.get)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=sweep_tracking_uri(sweep_dir))
    parent_id = (sweep_dir / "mlflow_parent_run_id").read_text().strip()
    runs = client.search_runs([client.get_experiment_by_name("relax").experiment_id])
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent_id]
    assert sorted(r.data.params["algorithm.advantage_estimator"] for r in children) == ["grpo", "rloo"]

    for name in ("grpo", "rloo"):
        (run_file,) = (points[name] / "wandb").glob("offline-run-*/run-*.wandb")
        (run,) = [r.run for r in wandb_records(run_file) if r.HasField("run")]
        assert run.run_group == sweep_group(sweep_dir.resolve())
