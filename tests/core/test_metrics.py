"""MetricsSink: metrics.jsonl, the MLflow SQLite run (params, per-step metrics, artefacts), the plot."""

from __future__ import annotations

import getpass
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient
from omegaconf import OmegaConf
from selection import selected

from relax_core.errors import RelaxUserError
from relax_core.telemetry.metrics import MetricsSink, check_tracking_server, flatten, format_step_line

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def step_metrics(step: int) -> dict[str, float]:
    return {
        "reward/mean": 0.1 * step,
        "reward/std": 0.05,
        "loss": -0.01 * step,
        "kl": 0.0,
        "entropy": 1.5,
        "tokens_per_s": 1000.0 + step,
        "step_time_s": 0.4,
        "time/rollout_s": 0.2,
        "pass@1": 0.5,  # MLflow forbids '@' in names: it is renamed, not dropped
    }


def resolved_of(cfg) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def test_flatten() -> None:
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": {}, "f": None}) == {
        "a.b": 1,
        "a.c.d": [1, 2],
        "e": {},
        "f": None,
    }


def test_format_step_line() -> None:
    line = format_step_line(3, 10, step_metrics(3) | {"eval/accuracy": 0.25, "staleness/mean": 1.0})
    assert line.startswith("step    3/10 | reward 0.300±0.050 | eval acc 0.250")
    assert "stale 1.0" in line and "1003 tok/s" in line and line.endswith("0.40s")
    assert "| loss " in line and "| ent " in line
    frozen = format_step_line(1, 10, step_metrics(1) | {"actor_frozen": 1.0, "entropy": math.nan})
    assert "actor waits for the critic" in frozen and "ent" not in frozen and "nan" not in frozen


def test_sink_writes_jsonl_mlflow_and_plot(make_cfg, tmp_path: Path) -> None:
    cfg = make_cfg("logger.run_name=sink-test")
    resolved = resolved_of(cfg)
    sink = MetricsSink(cfg, resolved)
    sink.log(0, {"eval/accuracy_init": 0.0, "eval/accuracy": 0.125})
    for step in (1, 2, 3):
        metrics = step_metrics(step)
        if step == 3:
            metrics |= {"eval/accuracy": 0.5, "grad_norm": math.nan}
        sink.log(step, metrics)
    sink.finish({"status": "finished", "steps": 3, "reward_gain": 0.2, "output_dir": str(tmp_path)})

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[2]["reward/mean"] == pytest.approx(0.2) and records[3]["eval/accuracy"] == 0.5
    assert math.isnan(records[3]["grad_norm"])
    assert json.loads((tmp_path / "summary.json").read_text())["reward_gain"] == 0.2
    saved = OmegaConf.load(tmp_path / "config.yaml")
    assert OmegaConf.to_container(saved) == resolved
    png = tmp_path / "reward_curve.png"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5000

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("relax")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "sink-test"
    # the tags MLflow's UI shows in its User and Source columns
    assert (
        run.data.tags["mlflow.user"] == getpass.getuser() and run.data.tags["mlflow.source.type"] == "LOCAL"
    )
    params = run.data.params
    assert params["algorithm.name"] == "grpo"
    assert params["rollout.batch_size"] == "4"
    assert params["trainer.lr"] == str(cfg.trainer.lr)
    assert params["model.tiny.hidden_size"] == "128"
    assert len(params) == len(flatten(resolved))
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert sorted((m.step, round(m.value, 6)) for m in history) == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/accuracy")] in ([0, 3], [3, 0])
    assert len(client.get_metric_history(run.info.run_id, "pass_1")) == 3
    assert client.get_metric_history(run.info.run_id, "grad_norm") == []  # non-finite values are skipped
    assert run.data.metrics["summary/reward_gain"] == pytest.approx(0.2)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "reward_curve.png", "summary.json"} <= artifacts
    assert mlflow.active_run() is None


def test_final_eval_taken_after_the_last_step_is_plotted_there(make_cfg, tmp_path: Path) -> None:
    """With ``trainer.eval_every=0`` the only evals are the one before training and the summary's final one,
    taken after the last step: the plot shows both."""
    cfg = make_cfg("logger=jsonl")
    sink = MetricsSink(cfg, resolved_of(cfg))
    sink.log(0, {"eval/accuracy": 0.125})
    for step in (1, 2, 3):
        sink.log(step, step_metrics(step))
    assert sink.eval_points() == [(0, 0.125)]
    assert sink.eval_points(0.75) == [(0, 0.125), (3, 0.75)]
    sink.log(3, {"eval/accuracy": 0.5})  # an eval logged at the last step is the one drawn there
    assert sink.eval_points(0.75) == [(0, 0.125), (3, 0.5)]
    sink.finish({"status": "finished", "steps": 3, "eval_accuracy_final": 0.75})
    assert (tmp_path / "reward_curve.png").read_bytes()[:8] == PNG_MAGIC


def test_failed_run_is_marked_failed(make_cfg, tmp_path: Path) -> None:
    cfg = make_cfg()
    sink = MetricsSink(cfg, resolved_of(cfg))
    sink.finish({"status": "failed"}, status="FAILED")
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("relax").experiment_id])
    assert run.info.status == "FAILED"
    assert not (tmp_path / "reward_curve.png").exists()  # nothing to plot


def test_jsonl_logger_writes_no_mlflow_store(make_cfg, tmp_path: Path) -> None:
    cfg = make_cfg("logger=jsonl", "logger.plot=false")
    sink = MetricsSink(cfg, resolved_of(cfg))
    sink.log(1, step_metrics(1))
    sink.finish({"status": "finished"})
    assert not (tmp_path / "mlflow.db").exists()
    assert not (tmp_path / "reward_curve.png").exists()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["step"] == 1


def test_a_fresh_start_after_a_run_killed_before_its_first_checkpoint_logs_step_0_once(
    make_cfg, tmp_path: Path
) -> None:
    cfg = make_cfg("logger=jsonl", "logger.plot=false")
    killed = MetricsSink(cfg, resolved_of(cfg))
    killed.log(0, {"eval/accuracy": 0.125})  # then killed while saving checkpoint 0: nothing to resume
    killed.jsonl.close()
    again = MetricsSink(cfg, resolved_of(cfg))
    again.log(0, {"eval/accuracy": 0.125})
    again.log(1, step_metrics(1))
    again.finish({"status": "finished"})
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]


@pytest.fixture
def full_disk(tmp_path: Path):
    """A 1 MiB tmpfs, filled up by the test: a real ENOSPC, not a simulated one."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_names_the_path_in_one_line_and_leaves_no_empty_summary(
    make_cfg, full_disk: Path
) -> None:
    cfg = make_cfg("logger=jsonl", "logger.plot=false")
    cfg.output_dir = str(full_disk / "run")
    sink = MetricsSink(cfg, resolved_of(cfg))
    sink.log(1, step_metrics(1))
    with open(full_disk / "filler", "wb") as f, pytest.raises(OSError):
        while True:
            f.write(b"x" * 65536)
            f.flush()
    with pytest.raises(RelaxUserError, match="no space left") as err:
        sink.finish({"status": "finished", "steps": 1, "note": "x" * 100_000})
    assert str(full_disk / "run") in str(err.value) and "\n" not in str(err.value)
    summary = full_disk / "run" / "summary.json"
    assert not summary.exists() or json.loads(summary.read_text())  # never an empty file
    assert not list((full_disk / "run").glob("*.tmp*"))  # no temp file left behind


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_tracking_server_fails_at_once_naming_the_key() -> None:
    with pytest.raises(RelaxUserError, match=r"logger.tracking_uri='http://127.0.0.1:\d+': no MLflow server"):
        check_tracking_server(f"http://127.0.0.1:{free_port()}")
    check_tracking_server(None)  # the run dir's SQLite store: nothing to reach
    check_tracking_server("sqlite:///elsewhere/mlflow.db")


@pytest.fixture(scope="module", autouse=True)
def mlflow_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The ``mlflow server`` of test_sink_logs_to_an_mlflow_server, started as the module starts (when that
    test is selected): its seconds of imports and store migration run beside the tests before it rather
    than ahead of it. Yields ``(uri, process)``; not waited for here."""
    if not selected(request, "test_sink_logs_to_an_mlflow_server"):
        yield None
        return
    root = tmp_path_factory.mktemp("mlflow_server")
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{root / 'server.db'}",
            "--artifacts-destination",
            str(root / "server_artifacts"),
            "--workers",
            "1",
        ],
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_sink_logs_to_an_mlflow_server(make_cfg, tmp_path: Path, mlflow_server) -> None:
    """``logger.tracking_uri=http://...``: a real ``mlflow server``, artifacts through its proxy."""
    uri, server = mlflow_server
    for _ in range(1200):  # the server imports and migrates its store first
        try:
            check_tracking_server(uri, timeout_s=1.0)
            break
        except RelaxUserError:
            assert server.poll() is None, "mlflow server exited"
            time.sleep(0.1)
    cfg = make_cfg(f"logger.tracking_uri={uri}", "logger.run_name=served")
    sink = MetricsSink(cfg, resolved_of(cfg))
    for step in (1, 2):
        sink.log(step, step_metrics(step))
    sink.finish({"status": "finished", "steps": 2, "reward_gain": 0.1})
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("relax").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "served"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")] == [1, 2]
    assert {"config.yaml", "summary.json", "reward_curve.png"} <= {
        a.path for a in client.list_artifacts(run.info.run_id)
    }
    assert not (tmp_path / "mlflow.db").exists()  # nothing went to the run dir's store
