"""A plain (non-editable) install carries the config tree (the wheel holds ``relax_launch/conf``) and the
native kernels' C++ source."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
IGNORE = shutil.ignore_patterns(
    ".git",
    ".venv",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    "outputs",
    "multirun",
    "mlruns",
    "tests",
    ".*cache",
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build from a copy of the source tree, so the checkout gets no build/ or egg-info changes."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=IGNORE, symlinks=True)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (built,) = (tmp / "dist").glob("relax-*.whl")
    return built


@pytest.mark.slow
def test_wheel_contains_every_config_file(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "relax_launch/conf/config.yaml" in names
    expected = {
        f"relax_launch/conf/{path.relative_to(REPO / 'conf').as_posix()}"
        for path in (REPO / "conf").rglob("*.yaml")
    }
    groups = {p.parent.name for p in (REPO / "conf").glob("*/*.yaml")}
    assert {"algorithm", "model", "trainer", "experiment"} <= groups
    assert expected - names == set(), f"missing from the wheel: {sorted(expected - names)}"
    for package in ("relax_launch", "relax_core", "relax_rewards", "relax_models"):
        assert f"{package}/__init__.py" in names
    assert "relax_launch/__main__.py" in names and "relax_core/run_loop.py" in names
    assert "relax_core/engines/decode_kernels.cpp" in names  # rollout.native_kernels compiles it on first use
    assert not any(n.startswith("tests/") for n in names)


@pytest.mark.slow
def test_unpacked_wheel_composes_without_the_checkout(wheel: Path, tmp_path: Path) -> None:
    """The unpacked wheel, first on sys.path, runs ``--cfg job`` from a folder far from the repo."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = str(site)
    # where the CLI module and the config package resolve from, without executing the CLI module (its
    # torch import, seconds): the --cfg job run below, same folder and PYTHONPATH, imports what resolves here
    probe = (
        "import importlib.util as u; print(u.find_spec('relax_launch.cli').origin); "
        "print(u.find_spec('relax_launch.conf').origin)"
    )
    where = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert where.returncode == 0, where.stderr[-2000:]
    assert all(line.startswith(str(site)) for line in where.stdout.split()), where.stdout
    result = subprocess.run(
        [sys.executable, "-m", "relax_launch", "--cfg", "job", "algorithm=gspo", "experiment=digits_kl"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    cfg = yaml.safe_load(result.stdout)
    assert cfg["algorithm"]["name"] == "gspo" and cfg["algorithm"]["kl_loss_coef"] == 0.01
