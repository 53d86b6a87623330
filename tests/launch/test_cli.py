"""``python -m relax_launch`` as a user runs it: bad input fails fast with one ``error:`` line, no traceback,
before Ray starts; the inspection flags exit 0.

Each distinct behaviour runs once as the real command; they all start as the module starts (each is a fresh
interpreter importing torch and transformers, seconds on 2 cores) and run while the in-process tests do, the
tests reading their results coming last. The other cases of a behaviour proven that way call, in this
process, the very function the CLI calls for them (its override pre-check, the run pipeline, its Hydra entry
point).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tiers import heavy

import relax_launch.cli
from relax_core.errors import RelaxUserError
from relax_launch.cluster import LAUNCHERS

RAY_MARKERS = ("Started a local Ray instance", "Ray up:")


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def data_files(tmp: Path) -> dict[str, str]:
    good = json.dumps({"prompt": "sort 21:", "label": "12"})
    return {
        "empty": write(tmp / "empty.jsonl", ""),
        "bad_json": write(tmp / "bad_json.jsonl", f'{good}\n{{"prompt": "sort 3:", "label"\n{good}\n'),
        "no_prompt": write(
            tmp / "no_prompt.jsonl", f"{good}\n{json.dumps({'question': 'sort 3:', 'label': '3'})}\n"
        ),
    }


def case_args(case: str, tmp: Path) -> list[str]:
    """The command-line arguments of each case (the ``data_*`` cases read files written under ``tmp``)."""
    if case.startswith("data_"):
        return ["data=jsonl", f"data.train_path={data_files(tmp)[case.removeprefix('data_')]}"]
    return {
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
    }[case]


# one real command per behaviour: a bad override, a bad input met by the run before Ray, the placement
# check that needs Ray, and the Hydra flags that configure logging (run in this process they would leave
# their log handlers on the test session's root logger)
SUBPROCESS_CASES = ("unknown_key", "data_bad_json", "cpus_short", "defaults_tree", "help")


@pytest.fixture(scope="module", autouse=True)
def cli_started(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Starts the real commands as the module starts, so that the in-process tests run while they import;
    each writes its output to files (a pipe nobody reads could fill and stall it)."""
    tmp = tmp_path_factory.mktemp("cli")
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RAY_ADDRESS")}
    started = {}
    selected = [item for item in request.session.items if item.module is request.module]
    for name in SUBPROCESS_CASES if any("cli" in item.fixturenames for item in selected) else ():
        workdir = tmp / name
        workdir.mkdir()
        args = case_args(name, tmp)
        if not any(a.startswith("-") for a in args):
            args = [*args, f"hydra.run.dir={workdir / 'run'}"]
        out, err = tmp / f"{name}.stdout", tmp / f"{name}.stderr"
        with open(out, "w") as stdout, open(err, "w") as stderr:
            process = subprocess.Popen(
                [sys.executable, "-m", "relax_launch", *args],
                cwd=workdir,
                env=env,
                stdout=stdout,
                stderr=stderr,
            )
        started[name] = (process, args, out, err)
    yield tmp, started
    for process, *_ in started.values():
        if process.poll() is None:  # not waited for: its tests were not run or failed first
            process.terminate()
            process.wait(timeout=60)


@pytest.fixture(scope="module")
@heavy("launches `python -m relax_launch` (started by cli_started)")
def cli(cli_started) -> dict[str, subprocess.CompletedProcess]:
    tmp, started = cli_started
    results = {}
    for name, (process, args, out, err) in started.items():
        process.wait(timeout=600)
        results[name] = subprocess.CompletedProcess(
            args, process.returncode, out.read_text(), err.read_text()
        )
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


def precheck_in_process(args: list[str], capsys: pytest.CaptureFixture[str]) -> subprocess.CompletedProcess:
    """The override pre-check ``relax_launch.cli.main`` runs before Hydra, here: it must exit by itself."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        relax_launch.cli.exit_on_bad_overrides(args)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, exit_.value.code, out, err)


def main_in_process(
    args: list[str], cwd: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> subprocess.CompletedProcess:
    """``relax_launch.cli.main`` run here with ``args`` as its command line, from ``cwd``: the override
    pre-check, then the Hydra entry point (main's exit-time ``gc.freeze`` is left out: it is for the
    interpreter's exit, not this session's)."""
    import ray
    from hydra.core.hydra_config import HydraConfig

    for key in ("HYDRA_FULL_ERROR", "RAY_ADDRESS"):
        monkeypatch.delenv(key, raising=False)
    # --cfg leaves its composition in Hydra's process-wide HydraConfig; put back what was there after
    monkeypatch.setattr(HydraConfig.instance(), "cfg", HydraConfig.instance().cfg)
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["relax_launch", *args])
    capsys.readouterr()
    code: int | str | None = 0
    try:
        relax_launch.cli.exit_on_bad_overrides(args)
        relax_launch.cli._hydra_main()
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    assert not ray.is_initialized()  # nothing here starts Ray
    return subprocess.CompletedProcess(args, code, out, err)


def run_in_process(case: str, tmp: Path, caplog: pytest.LogCaptureFixture) -> str:
    """The composed config of ``case`` handed to the run pipeline as the CLI hands it
    (``relax_launch.run.run_experiment``); returns the RelaxUserError the CLI prints as its one line, after
    checking that Ray never came up."""
    import ray

    from relax_launch.run import run_experiment

    cfg = relax_launch.cli.compose_config(case_args(case, tmp))
    cfg.output_dir = str(tmp / "run")  # what the CLI takes from hydra.run.dir
    caplog.set_level(logging.INFO)
    with pytest.raises(RelaxUserError) as err:
        run_experiment(cfg)
    assert not ray.is_initialized()
    assert not any(marker in caplog.text for marker in RAY_MARKERS), caplog.text[-2000:]
    message = str(err.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize(
    ("case", "needles"),
    [
        ("unknown_key", ["trainer.foo"]),
        ("wrong_type", ["trainer.lr", "abc"]),
        ("unknown_option", ["algorithm/nope", "grpo"]),
        ("plus_key", ["trainer.x"]),
    ],
)
def test_bad_override_fails_fast_naming_the_key(
    case: str, needles: list[str], tmp_path: Path, capsys
) -> None:
    # the CLI's pre-check, in this process; the real command is test_bad_override_on_the_command_line
    result = precheck_in_process([*case_args(case, tmp_path), f"hydra.run.dir={tmp_path / 'run'}"], capsys)
    assert_one_error_line(result, *needles)
    assert result.stdout.strip() == ""  # nothing composed, nothing started
    assert not (tmp_path / "run").exists()


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
def test_bad_input_fails_before_ray_with_one_line(
    tmp_path: Path, caplog, case: str, needles: list[str]
) -> None:
    # the run pipeline, in this process; the real command is test_bad_input_on_the_command_line
    message = run_in_process(case, tmp_path, caplog)
    for needle in needles:
        assert needle in message, message


def test_in_process_refuses_what_needs_several_processes_with_one_line(tmp_path: Path, caplog) -> None:
    # the launcher's refusal, raised in the run pipeline as the bad inputs above (same one-line CLI path)
    message = run_in_process("in_process_engines", tmp_path, caplog)
    for needle in ("cluster=in_process", "needs rollout.num_engines=1 (got 2", "cluster=local"):
        assert needle in message, message


def test_cfg_job_prints_the_composed_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    # the CLI's Hydra entry point, in this process (--help and --info run as real commands below)
    results = {}
    for case in ("cfg_job", "cfg_job_override"):
        (tmp_path / case).mkdir()
        results[case] = main_in_process(case_args(case, tmp_path), tmp_path / case, monkeypatch, capsys)
    result = results["cfg_job"]
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
    assert results["cfg_job_override"].returncode == 0, results["cfg_job_override"].stderr[-2000:]
    overridden = yaml.safe_load(results["cfg_job_override"].stdout)
    assert overridden["algorithm"]["name"] == "gspo" and overridden["trainer"]["lr"] == 0.01
    for case, done in results.items():  # inspection starts nothing and writes nothing
        assert not any(marker in done.stdout + done.stderr for marker in RAY_MARKERS)
        assert list((tmp_path / case).iterdir()) == []


def test_bad_override_on_the_command_line_fails_fast_with_one_line(cli) -> None:
    result = cli["unknown_key"]
    assert_one_error_line(result, "trainer.foo")
    assert result.stdout.strip() == ""  # nothing composed, nothing started
    assert not (cli["_tmp"] / "unknown_key" / "run").exists()


def test_bad_input_on_the_command_line_fails_before_ray_with_one_line(cli) -> None:
    result = cli["data_bad_json"]
    line = assert_one_error_line(result, "bad_json.jsonl", "line 2", "invalid JSON")
    output = result.stdout + result.stderr
    assert not any(marker in output for marker in RAY_MARKERS), output[-2000:]
    assert line not in result.stdout  # once on the console, not again in Hydra's log lines
    assert line in (cli["_tmp"] / "data_bad_json" / "run" / "cli.log").read_text()  # the run dir keeps it


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
    assert "colocate" in groups["mode"]
    # the options, not the schemas they extend
    assert sorted(o.strip() for o in groups["cluster"].split(",")) == sorted(LAUNCHERS), groups["cluster"]
