"""``python -m relax_launch`` as a user runs it: bad input fails fast with one ``error:`` line, no traceback,
before Ray starts; the inspection flags exit 0.

All invocations start at once in a module fixture (each is a fresh interpreter importing torch and
transformers), so the module costs about as much as its slowest run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

RAY_MARKERS = ("Started a local Ray instance", "Ray up:")


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("cli")
    good = json.dumps({"prompt": "sort 21:", "label": "12"})
    data = {
        "empty": write(tmp / "empty.jsonl", ""),
        "bad_json": write(tmp / "bad_json.jsonl", f'{good}\n{{"prompt": "sort 3:", "label"\n{good}\n'),
        "no_prompt": write(
            tmp / "no_prompt.jsonl", f"{good}\n{json.dumps({'question': 'sort 3:', 'label': '3'})}\n"
        ),
    }
    cases: dict[str, list[str]] = {
        "unknown_key": ["trainer.foo=1"],
        "wrong_type": ["trainer.lr=abc"],
        "unknown_option": ["algorithm=nope"],
        "plus_key": ["+trainer.x=1"],
        "cfg_job": ["--cfg", "job"],
        "cfg_job_override": ["--cfg", "job", "algorithm=gspo", "trainer.lr=0.01"],
        "defaults_tree": ["--info", "defaults-tree"],
        "help": ["--help"],
        "missing_model": ["model=qwen3_4b", "model.path=/nonexistent"],
        "mlflow_unreachable": ["logger.tracking_uri=http://127.0.0.1:9"],  # port 9: nothing listens
        "cpus_short": ["trainer.num_cpus=3", "cluster.num_cpus=2"],
        "in_process_engines": ["cluster=in_process", "rollout.num_engines=2"],
        **{f"data_{name}": ["data=jsonl", f"data.train_path={path}"] for name, path in data.items()},
    }
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RAY_ADDRESS")}

    def run(name: str) -> subprocess.CompletedProcess:
        workdir = tmp / name
        workdir.mkdir()
        args = cases[name]
        if not any(a.startswith("-") for a in args):
            args = [*args, f"hydra.run.dir={workdir / 'run'}"]
        return subprocess.run(
            [sys.executable, "-m", "relax_launch", *args],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = dict(zip(cases, pool.map(run, cases), strict=True))
    results["_tmp"] = tmp  # type: ignore[assignment]
    return results


def assert_one_error_line(result: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2, no traceback, and stderr is exactly one line: ``error: ...`` naming every needle."""
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output[-3000:]
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr[-3000:]
    (line,) = lines
    assert line.startswith("error: "), line
    for needle in needles:
        assert needle in line, line
    assert result.returncode == 2, (result.returncode, output[-2000:])
    return line


@pytest.mark.parametrize(
    ("case", "needles"),
    [
        ("unknown_key", ["trainer.foo"]),
        ("wrong_type", ["trainer.lr", "abc"]),
        ("unknown_option", ["algorithm/nope", "grpo"]),
        ("plus_key", ["trainer.x"]),
    ],
)
def test_bad_override_fails_fast_naming_the_key(cli, case: str, needles: list[str]) -> None:
    result = cli[case]
    assert_one_error_line(result, *needles)
    assert result.stdout.strip() == ""  # nothing composed, nothing started
    assert not (cli["_tmp"] / case / "run").exists()


@pytest.mark.parametrize(
    ("case", "needles"),
    [
        ("missing_model", ["model.path='/nonexistent'"]),
        ("mlflow_unreachable", ["logger.tracking_uri='http://127.0.0.1:9'", "no MLflow server answers"]),
        ("data_empty", ["empty.jsonl", "no rows"]),
        ("data_bad_json", ["bad_json.jsonl", "line 2", "invalid JSON"]),
        ("data_no_prompt", ["no_prompt.jsonl", "row 1", "prompt"]),
    ],
)
def test_bad_input_fails_before_ray_with_one_line(cli, case: str, needles: list[str]) -> None:
    result = cli[case]
    assert_one_error_line(result, *needles)
    output = result.stdout + result.stderr
    assert not any(marker in output for marker in RAY_MARKERS), output[-2000:]


def test_more_logical_cpus_than_the_cluster_has_fails_with_one_error_naming_the_knobs(cli) -> None:
    """Caught when the placement group is asked for, not after Ray's 120 s wait for it; the run's MLflow
    record, opened by then, ends FAILED rather than RUNNING forever."""
    result = cli["cpus_short"]
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert errors == [
        "error: the roles of relax-colocate need 3.5 CPU in Ray but the cluster has 2 CPU: raise "
        "cluster.num_cpus/cluster.num_gpus or lower rollout.num_cpus/trainer.num_cpus (logical shares, not cores)"
    ], result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr
    assert result.returncode == 2
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{cli['_tmp'] / 'cpus_short' / 'run' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("relax").experiment_id])
    assert run.info.status == "FAILED"


def test_in_process_refuses_what_needs_several_processes_with_one_line(cli) -> None:
    result = cli["in_process_engines"]
    assert_one_error_line(result, "cluster=in_process", "needs rollout.num_engines=1 (got 2", "cluster=local")
    assert not any(marker in result.stdout + result.stderr for marker in RAY_MARKERS)


def test_cfg_job_prints_the_composed_config(cli) -> None:
    result = cli["cfg_job"]
    assert result.returncode == 0, result.stderr[-2000:]
    cfg = yaml.safe_load(result.stdout)
    assert cfg["algorithm"]["name"] == "grpo" and cfg["model"]["name"] == "tiny_qwen3"
    assert {
        "algorithm",
        "model",
        "modality",
        "mode",
        "cluster",
        "data",
        "reward",
        "rollout",
        "trainer",
        "logger",
    } <= set(cfg)
    assert "hydra" not in cfg
    overridden = yaml.safe_load(cli["cfg_job_override"].stdout)
    assert overridden["algorithm"]["name"] == "gspo" and overridden["trainer"]["lr"] == 0.01
    for case in ("cfg_job", "cfg_job_override"):  # inspection starts nothing and writes nothing
        assert not any(marker in cli[case].stdout + cli[case].stderr for marker in RAY_MARKERS)
        assert list((cli["_tmp"] / case).iterdir()) == []


def test_info_defaults_tree(cli) -> None:
    result = cli["defaults_tree"]
    assert result.returncode == 0, result.stderr[-2000:]
    for line in (
        "algorithm: grpo",
        "model: tiny_qwen3",
        "mode: colocate",
        "cluster: local",
        "logger: mlflow",
    ):
        assert line in result.stdout


def test_help_lists_groups_and_options(cli) -> None:
    result = cli["help"]
    assert result.returncode == 0, result.stderr[-2000:]
    section = result.stdout.split("== Configuration groups ==", 1)[1].split("== Config ==", 1)[0]
    groups = {
        line.split(":", 1)[0]: line.split(":", 1)[1] for line in section.splitlines() if line.count(":") == 1
    }
    assert "grpo" in groups["algorithm"] and "gspo" in groups["algorithm"]
    assert "tiny_qwen3" in groups["model"]
    assert "colocate" in groups["mode"] and "local" in groups["cluster"]
