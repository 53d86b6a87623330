"""Bad user files found before anything starts, each as one line naming the file: a reward that does not
import, a broken model folder (issue 45)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from relax_core.errors import RelaxUserError
from relax_core.preflight.validation import validate
from relax_models.loader import resolve_model_path


@pytest.mark.parametrize(
    ("key", "source", "needles"),
    [
        ("reward._target_", "def f(r, l, m=None):\n    return 1 +\n", ["line 2", "SyntaxError"]),
        ("reward._target_", "import no_such_module_x\n", ["line 1", "No module named 'no_such_module_x'"]),
        ("+reward.plugins", "def f(:\n", ["line 1", "SyntaxError"]),
    ],
)
def test_a_reward_that_does_not_import_is_one_line_naming_the_file(
    make_cfg, tmp_path: Path, key: str, source: str, needles: list[str]
) -> None:
    file = tmp_path / "my_reward.py"
    file.write_text(source)
    value = f"[{file}]" if key.endswith("plugins") else f"{file}:f"
    with pytest.raises(RelaxUserError) as err:
        validate(make_cfg(f"{key}={value}"))
    message = str(err.value)
    assert "\n" not in message and str(file) in message and key.lstrip("+") in message, message
    for needle in needles:
        assert needle in message, message


def _broken(tiny_model_dir: Path, tmp_path: Path, how: str) -> Path:
    folder = tmp_path / how
    shutil.copytree(tiny_model_dir, folder)
    if how == "config":
        (folder / "config.json").write_text('{"model_type": "qwen3", ')
    else:
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return folder


@pytest.mark.parametrize(
    ("how", "needles"),
    [("config", ["config.json", "not valid JSON"]), ("weights", ["model.safetensors", "truncated"])],
)
def test_a_broken_model_folder_is_one_line_naming_the_file(
    make_cfg, tiny_model_dir: Path, tmp_path: Path, how: str, needles: list[str]
) -> None:
    folder = _broken(tiny_model_dir, tmp_path, how)
    cfg = make_cfg(f"model.path={folder}")
    assert resolve_model_path(make_cfg(f"model.path={tiny_model_dir}").model, str(tmp_path), 0)  # intact
    with pytest.raises(RelaxUserError) as err:
        resolve_model_path(cfg.model, str(tmp_path), 0)
    message = str(err.value)
    assert "\n" not in message and f"model.path='{folder}'" in message, message
    for needle in needles:
        assert needle in message, message


def test_an_unknown_server_weight_update_is_one_line_naming_the_choices(make_cfg) -> None:
    validate(make_cfg("rollout=vllm", "rollout.server_weight_update=disk"))
    with pytest.raises(RelaxUserError) as err:
        validate(make_cfg("rollout=vllm", "rollout.server_weight_update=nccl"))
    message = str(err.value)
    assert "\n" not in message and "rollout.server_weight_update='nccl'" in message, message
    assert "['distributed', 'disk']" in message, message


def test_async_in_one_process_names_the_bus_it_needs(make_cfg) -> None:
    validate(make_cfg("cluster=in_process", "mode=async", "mode.databus=memory"))
    with pytest.raises(RelaxUserError) as err:
        validate(make_cfg("cluster=in_process", "mode=async"))
    message = str(err.value)
    assert "\n" not in message and "set mode.databus=memory" in message, message
    with pytest.raises(RelaxUserError, match="mode.databus='memory' is not one of"):
        validate(make_cfg("mode=async", "mode.databus=memory"))  # across processes it cannot carry rows
