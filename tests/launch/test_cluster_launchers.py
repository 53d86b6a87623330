"""``cluster=...``: each option composes into its own schema and runs through its own launcher, which calls
the experiment function it is given (no way back into relax_launch.run)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ray
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from relax_core.config.schema import LocalClusterConfig, SlurmAllocationConfig
from relax_core.errors import RelaxUserError
from relax_launch.cli import CONFIG_MODULE, composition_problem
from relax_launch.cluster import LAUNCHERS, launcher_for
from relax_launch.cluster.local import LocalLauncher
from relax_launch.cluster.slurm_allocation import SlurmAllocationLauncher

OPTIONS = sorted(p.stem for p in (Path(__file__).parents[2] / "conf" / "cluster").glob("*.yaml"))


@pytest.mark.parametrize("option", OPTIONS)
def test_each_option_composes_into_its_launchers_schema(option: str) -> None:
    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        cluster = OmegaConf.to_object(compose("config", overrides=[f"cluster={option}"])).cluster
    assert type(cluster) is LAUNCHERS[option].schema
    assert type(launcher_for(cluster)) is LAUNCHERS[option]


def test_a_field_of_another_option_is_rejected_with_one_line() -> None:
    problem = composition_problem(["cluster=local", "cluster.partition=gpu"])
    assert problem is not None and "\n" not in problem
    assert "cluster.partition" in problem and "LocalClusterConfig" in problem
    assert "cluster.num_cpus" in composition_problem(["cluster=slurm", "cluster.num_cpus=4"])
    assert "cluster.partition" in composition_problem(["cluster=ray", "+cluster.partition=gpu"])
    assert composition_problem(["cluster=slurm", "cluster.partition=gpu", "cluster.nodes=2"]) is None


def test_a_renamed_option_is_a_user_error() -> None:
    with pytest.raises(RelaxUserError, match="cluster.name='slurm'"):
        launcher_for(LocalClusterConfig(name="slurm"))


def test_slurm_allocation_outside_a_job_fails_before_running(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("SLURM_JOB_ID", "RAY_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    cfg = OmegaConf.structured({"cluster": SlurmAllocationConfig()})

    def experiment(cfg, connect):
        raise AssertionError("must not run")

    with pytest.raises(RelaxUserError, match="not inside a Slurm job"):
        SlurmAllocationLauncher(SlurmAllocationConfig()).launch(cfg, experiment)


def test_local_launcher_runs_the_given_experiment_on_its_own_ray(ray_started_in_test) -> None:
    seen = {}

    def experiment(cfg, connect):
        seen["before"] = ray.is_initialized()
        connect({"env_vars": {"RELAX_LAUNCH_TEST": "1"}})
        seen["cpus"] = ray.cluster_resources()["CPU"]
        seen["env"] = ray.get(ray.remote(lambda: os.environ.get("RELAX_LAUNCH_TEST")).remote())
        return {"status": "finished", "cfg": cfg}

    summary = LocalLauncher(LocalClusterConfig(num_cpus=1)).launch("the config", experiment)
    assert summary == {"status": "finished", "cfg": "the config"}
    assert seen == {"before": False, "cpus": 1.0, "env": "1"}
