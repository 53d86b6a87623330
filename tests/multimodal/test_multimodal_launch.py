"""The launcher with modalities: configs compose, a modality the model family cannot take is refused before
Ray starts, the GPU recipes compose and require model.path, and the tiny vision/audio experiments learn."""

from __future__ import annotations

from pathlib import Path

import launching
import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

import relax_launch.cli  # noqa: F401  (registers the config schema with Hydra)
from relax_core.config.schema import RelaxConfig
from relax_core.errors import RelaxUserError
from relax_core.preflight.validation import validate
from relax_models.families import FAMILIES, get_family

CONF = Path(__file__).resolve().parents[2] / "conf"
MODALITY_OPTIONS = sorted(p.stem for p in (CONF / "modality").glob("*.yaml"))


def _compose(overrides: list[str]) -> RelaxConfig:
    with initialize_config_module("relax_launch.conf", version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    return OmegaConf.to_object(cfg)


def test_model_configs_match_their_families() -> None:
    assert MODALITY_OPTIONS == ["audio", "omni", "text", "vision"]
    for file in sorted((CONF / "model").glob("*.yaml")):
        cfg = _compose([f"model={file.stem}"])
        spec = get_family(cfg.model.family)
        assert cfg.model.modalities == [m for m in spec.modalities if m in MODALITY_OPTIONS], file.name
        if file.stem.startswith("tiny_"):
            assert cfg.model.tiny is not None and cfg.model.path is None
        else:
            assert spec.examples and cfg.model.dtype == "bfloat16"
    tiny_families = {_compose([f"model={f.stem}"]).model.family for f in (CONF / "model").glob("tiny_*.yaml")}
    assert tiny_families == set(FAMILIES)


@pytest.mark.parametrize(
    ("model", "modality", "ok"),
    [
        ("tiny_qwen3", "text", True),
        ("tiny_qwen3", "vision", False),
        ("tiny_qwen3_moe", "audio", False),
        ("tiny_qwen3_vl", "vision", True),
        ("tiny_qwen3_vl", "audio", False),
        ("tiny_qwen3_vl_moe", "omni", False),
        ("tiny_qwen3_omni", "audio", True),
        ("tiny_qwen3_omni", "omni", True),
        ("qwen3_vl_30b_a3b", "vision", True),
    ],
)
def test_validation_checks_modality_against_family(model: str, modality: str, ok: bool) -> None:
    cfg = _compose([f"model={model}", f"modality={modality}", "model.path=/any"])
    if ok:
        validate(cfg)
    else:
        with pytest.raises(RelaxUserError, match=f"modality={modality} does not fit model={model}"):
            validate(cfg)


def test_launcher_refuses_a_modality_the_family_cannot_take(
    tmp_path: Path, relax_launch_cmd: list[str]
) -> None:
    args = ["model=tiny_qwen3_vl", "modality=audio"]
    result = launching.launch(
        tmp_path, *args, cwd=tmp_path, timeout=120, check=False, command=relax_launch_cmd
    )
    assert result.returncode == 2
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert lines == [
        "error: modality=audio does not fit model=tiny_qwen3_vl: model family qwen3_vl takes "
        "['text', 'vision', 'image', 'video']; choose one of those or a model family that takes audio"
    ]
    assert "Ray up" not in result.stdout + result.stderr
    assert not (tmp_path / "model_init").exists()  # refused before anything was built


RECIPES = {
    "dapo_math_qwen3_4b": {
        "model.family": "qwen3",
        "modality.name": "text",
        "algorithm.name": "dapo",
        "trainer.backend": "megatron",
        "rollout.batch_size": 32,
        "rollout.n_samples_per_prompt": 16,
        "rollout.max_new_tokens": 8192,
        "cluster.name": "local",
    },
    "openr1_qwen3_vl_4b": {
        "model.family": "qwen3_vl",
        "modality.name": "vision",
        "reward.name": "openr1mm",
        "rollout.batch_size": 32,
        "rollout.n_samples_per_prompt": 8,
    },
    "avqa_qwen3_omni_30b": {
        "model.family": "qwen3_omni",
        "modality.name": "omni",
        "reward.name": "multiple_choice",
        "cluster.name": "slurm",
        "cluster.nodes": 2,
        "cluster.gpus_per_node": 8,
        "rollout.num_engines": 8,
    },
}


def _gpus(cfg: RelaxConfig) -> float:
    """GPUs the colocated placement group asks for: engines plus actor ranks (see the controller)."""
    from relax_core.runtime.placement import actor_world_size

    return (
        cfg.rollout.num_engines * cfg.rollout.num_gpus + actor_world_size(cfg.trainer) * cfg.trainer.num_gpus
    )


# the node a recipe documents, for a machine without it (cluster=local detects a real node's GPUs)
HARDWARE = {"dapo_math_qwen3_4b": ["cluster.num_gpus=8"], "openr1_qwen3_vl_4b": ["cluster.num_gpus=8"]}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_recipes_compose_fill_their_gpus_and_require_model_path(recipe: str) -> None:
    node = HARDWARE.get(recipe, [])
    cfg = _compose([f"experiment={recipe}", *node])
    for key, expected in RECIPES[recipe].items():
        group, field = key.split(".")
        assert getattr(getattr(cfg, group), field) == expected, key
    total = (
        cfg.cluster.num_gpus if cfg.cluster.name == "local" else cfg.cluster.nodes * cfg.cluster.gpus_per_node
    )
    assert _gpus(cfg) == total  # engines and actor ranks fill the GPUs exactly
    with pytest.raises(RelaxUserError, match="set model.path="):
        validate(cfg)
    with pytest.raises(RelaxUserError, match="data.train_path is required"):
        validate(_compose([f"experiment={recipe}", *node, "model.path=/data/model"]))
    validate(
        _compose([f"experiment={recipe}", *node, "model.path=/data/model", "data.train_path=/data/t.jsonl"])
    )
    if cfg.cluster.name == "local":  # the recipe names no cluster setting: it composes with every cluster
        for cluster in ("ray", "slurm_allocation"):
            assert _compose([f"experiment={recipe}", f"cluster={cluster}"]).cluster.name == cluster


def test_recipe_prints_with_cfg_job(tmp_path: Path, relax_launch_cmd: list[str]) -> None:
    args = ["experiment=avqa_qwen3_omni_30b", "--cfg", "job"]
    result = launching.launch(None, *args, cwd=tmp_path, timeout=120, check=False, command=relax_launch_cmd)
    assert result.returncode == 0, result.stderr
    printed = OmegaConf.create(result.stdout)
    assert printed.model.name == "qwen3_omni_30b_a3b" and printed.cluster.nodes == 2
    assert dict(printed.modality["keys"]) == {"image": None, "video": "videos", "audio": "audios"}


def _run_experiment(relax_launch: list[str], experiment: str, tmp_path: Path) -> dict:
    args = [f"experiment={experiment}", "cluster.num_cpus=4"]
    launching.launch(tmp_path, *args, cwd=tmp_path, timeout=900, command=relax_launch)
    summary = launching.read_summary(tmp_path)
    assert summary["status"] == "finished"
    return summary


@pytest.mark.slow
def test_vision_experiment_learns_to_see_colours(tmp_path: Path, relax_launch_cmd: list[str]) -> None:
    summary = _run_experiment(relax_launch_cmd, "vision_colors_tiny_vl", tmp_path)
    assert summary["reward_gain"] > 0.2, summary
    # greedy accuracy is well above the 0.25 of a policy that ignores the image
    assert summary["eval_accuracy_final"] >= 0.6, summary
    assert (tmp_path / "data" / "media").is_dir() and (
        tmp_path / "model_init" / "processor_config.json"
    ).is_file()


@pytest.mark.slow
def test_audio_experiment_learns_to_hear_tones(tmp_path: Path, relax_launch_cmd: list[str]) -> None:
    summary = _run_experiment(relax_launch_cmd, "audio_tones_tiny_omni", tmp_path)
    assert summary["reward_gain"] > 0.2, summary
    assert summary["eval_accuracy_final"] >= 0.6, summary
    assert sorted(p.suffix for p in (tmp_path / "data" / "media").iterdir())[0] == ".wav"
