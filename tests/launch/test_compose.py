"""Every option of every config group composes against the schema (and validates where it can run).

Options are enumerated from the installed ``relax_launch.conf`` package, so a YAML file added later is
covered without touching this test.
"""

from __future__ import annotations

import functools
from importlib import resources

import pytest
from hydra import compose, initialize_config_module
from omegaconf import DictConfig, OmegaConf

import relax_launch.cli
from relax_core.config.schema import RelaxConfig
from relax_core.errors import RelaxUserError
from relax_core.preflight.validation import validate

CONF = resources.files("relax_launch.conf")
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and not p.name.startswith(("_", ".", "hydra")))


def options(group: str) -> list[str]:
    return sorted(p.name.removesuffix(".yaml") for p in (CONF / group).iterdir() if p.name.endswith(".yaml"))


GROUP_OPTIONS = [(g, o) for g in GROUPS if g != "experiment" for o in options(g)]
EXPERIMENTS = options("experiment") if "experiment" in GROUPS else []


@pytest.fixture(scope="module", autouse=True)
def hydra_context():
    """One Hydra initialisation for the module (re-initialising per compose is slow)."""
    with initialize_config_module(relax_launch.cli.CONFIG_MODULE, version_base="1.3"):
        yield


def compose_cfg(overrides: list[str]) -> DictConfig:
    return compose("config", overrides=list(overrides))


def typed(cfg: DictConfig) -> RelaxConfig:
    """The typed config the launcher runs (``output_dir`` is what the launcher sets)."""
    cfg.output_dir = "/tmp/relax-compose-test"
    config = OmegaConf.to_object(cfg)
    assert isinstance(config, RelaxConfig)
    return config


@functools.cache
def model_options() -> dict:
    return {m: typed(compose_cfg([f"model={m}"])).model for m in options("model")}


def models_for(modality: str) -> list[str]:
    """Model options whose family takes ``modality`` inputs, the ones that need no weights (tiny) first."""
    models = model_options()
    fitting = [m for m, model in models.items() if modality in model.modalities]
    return sorted(fitting, key=lambda m: models[m].tiny is None)


def validate_or_complete(overrides: list[str], config: RelaxConfig) -> None:
    """``validate`` the composed config (``config``: the caller's typed composition of ``overrides``, not
    composed a second time). An option that needs more than itself must say so in one RelaxUserError naming
    the missing piece; it is then completed the way a user would (a model folder, a dataset file, a model
    family that takes the modality) and must validate."""
    extra: list[str] = []
    for _ in range(4):
        try:
            validate(typed(compose_cfg([*overrides, *extra])) if extra else config)
            return
        except RelaxUserError as err:
            message = str(err)
        assert "\n" not in message
        if "reward.kwargs.url" in message:  # a judge/remote reward: completing it needs a live server
            return
        added = len(extra)
        if "model.path" in message and not any(e.startswith("model.path=") for e in extra):
            extra.append("model.path=/data/checkpoint")  # validate checks the choice, not the folder
        if "data.train_path" in message and not any(e.startswith("data.train_path=") for e in extra):
            extra.append("data.train_path=/data/train.jsonl")
        for key in ("trainer.num_gpus", "rollout.num_gpus"):  # a GPU engine beside a CPU trainer, or back
            if f"{key}=0 on a GPU run" in message and not any(e.startswith(f"{key}=") for e in extra):
                extra.append(f"{key}=0.5")
        if "raise cluster.num_gpus" in message and not any(e.startswith("cluster.num_gpus=") for e in extra):
            extra.append("cluster.num_gpus=8")  # a GPU option composed on a machine without GPUs
        modality = next((o.split("=", 1)[1] for o in overrides if o.startswith("modality=")), None)
        if modality and f"modality={modality}" in message and not any(e.startswith("model=") for e in extra):
            candidates = models_for(modality)
            assert candidates, f"no model option takes modality={modality}"
            extra.append(f"model={candidates[0]}")
        assert len(extra) > added, f"{overrides} + {extra} does not validate: {message}"
    raise AssertionError(f"{overrides} + {extra} still does not validate")


def test_every_group_has_options() -> None:
    expected = {
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
    }
    assert expected <= set(GROUPS)
    for group in GROUPS:
        assert options(group), f"conf/{group}/ has no options"
    # the default of each group in config.yaml is one of its options
    defaults = OmegaConf.load(CONF / "config.yaml").defaults
    for entry in defaults:
        if isinstance(entry, DictConfig) or isinstance(entry, dict):
            ((group, option),) = dict(entry).items()
            if option is not None:
                assert option in options(group), f"config.yaml default {group}={option} has no YAML file"


@pytest.mark.parametrize(("group", "option"), GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS])
def test_group_option_composes_against_the_schema(group: str, option: str) -> None:
    cfg = compose_cfg([f"{group}={option}"])
    relax_launch.cli.check_schema(cfg)
    config = typed(cfg)
    # the option file's own name field (every group schema has one) matches the file
    name = getattr(getattr(config, group), "name", option)
    assert name == option or group in ("reward",), f"conf/{group}/{option}.yaml sets name={name!r}"
    validate_or_complete([f"{group}={option}"], config)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_composes_and_validates(experiment: str) -> None:
    cfg = compose_cfg([f"experiment={experiment}"])
    relax_launch.cli.check_schema(cfg)
    validate_or_complete([f"experiment={experiment}"], typed(cfg))


def test_default_config_is_the_cpu_default() -> None:
    config = typed(compose_cfg([]))
    validate(config)
    assert (config.algorithm.name, config.model.name, config.mode.name, config.cluster.name) == (
        "grpo",
        "tiny_qwen3",
        "colocate",
        "local",
    )
    assert config.model.path is None and config.model.tiny is not None
    assert config.rollout.engine == "torch" and config.trainer.backend == "torch"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("mode.max_staleness=2", "mode.max_staleness must be 0"),
        ("rollout.top_p=0", "rollout.top_p"),
        ("rollout.n_samples_per_prompt=1", "n_samples_per_prompt >= 2"),
        ("algorithm.policy_loss=nope", "algorithm.policy_loss='nope'"),
        ("data.on_error=ignore", "data.on_error='ignore'"),
        ("trainer.total_steps=0", "trainer.total_steps must be >= 1"),
    ],
)
def test_validate_names_the_bad_key(override: str, message: str) -> None:
    config = typed(compose_cfg([override]))
    with pytest.raises(RelaxUserError, match=message.replace("(", r"\(").replace(".", r"\.")):
        validate(config)
