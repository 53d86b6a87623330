"""Which Python starts SGLang's server: SGLang pins its own torch, so it runs from a venv of its own."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from relax_core.config.schema import ModelConfig, RolloutConfig
from relax_core.engines import build_engine
from relax_core.engines.sglang import launch_command, sglang_python
from relax_core.errors import RelaxUserError


def test_sglang_python_config_then_env_then_install_venv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokenizer, tiny_model_dir: Path
) -> None:
    # a stand-in venv Python whose `sglang` probe succeeds: this interpreter with a package of that name
    site = tmp_path / "site" / "sglang"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    venv = tmp_path / "sglang-venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site.parent} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    monkeypatch.delenv("RELAX_SGLANG_PYTHON", raising=False)
    monkeypatch.setenv("RELAX_SGLANG_VENV", str(venv))
    assert sglang_python() == str(python)  # the install script's venv
    assert launch_command("/m", 1234, python=sglang_python())[:3] == [
        str(python),
        "-m",
        "sglang.launch_server",
    ]

    missing = str(tmp_path / "nope" / "python")
    monkeypatch.setenv("RELAX_SGLANG_PYTHON", missing)  # the environment beats the venv
    with pytest.raises(RelaxUserError, match="no Python at .*nope.*install_sglang.sh"):
        sglang_python()
    assert sglang_python(str(python)) == str(python)  # rollout.sglang_python beats both
    if importlib.util.find_spec("sglang") is None:  # the project's venv cannot hold SGLang's torch
        with pytest.raises(RelaxUserError, match="has no sglang"):
            sglang_python(sys.executable)
    # the engine starts from rollout.sglang_python, whatever the environment says
    monkeypatch.setenv("RELAX_SGLANG_PYTHON", str(python))
    with pytest.raises(RelaxUserError, match=f"rollout.engine=sglang cannot start: no Python at {missing}"):
        rollout = RolloutConfig(engine="sglang", sglang_python=missing)
        build_engine("sglang", str(tiny_model_dir), tokenizer, ModelConfig(), 0, rollout_cfg=rollout)
