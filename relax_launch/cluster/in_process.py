"""``cluster=in_process``: no Ray at all; every role is an object in this process.

The roles, the mode and the run loop are the same as on a Ray cluster: role groups are built from
:class:`~relax_core.runtime.handles.InProcessActor` handles instead of Ray actors, and the Actor hands its weights
to the rollout engine in memory (``in_process`` weight transfer). In ``mode=async`` each role runs its calls
on threads of its own and samples move through the in-memory bus (``mode.databus=memory``). What needs
several processes is refused up front with the setting to change.
"""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig

from relax_core.config.schema import InProcessClusterConfig
from relax_core.errors import RelaxUserError
from relax_launch.cluster.base import InProcessLauncher
from relax_launch.experiment import Experiment, Summary

log = logging.getLogger("relax")


def check_single_process(cfg: DictConfig) -> None:
    """One error naming the first setting that needs more than one process."""
    from relax_core.runtime.placement import actor_world_size

    r, t = cfg.rollout, cfg.trainer
    # key: (value in this run, the value a single process needs, why), as a user writes them
    needs_processes = {
        "rollout.engine": (r.engine, "torch", "vLLM and SGLang engines are servers of their own"),
        "rollout.num_engines": (str(r.num_engines), "1", "engines generate side by side"),
        "trainer.backend": (t.backend, "torch", "megatron ranks are processes"),
        "trainer.dp_size": (str(actor_world_size(t)), "1", "FSDP ranks are processes"),
        "control_plane.enabled": (
            str(bool(cfg.control_plane.enabled)).lower(),
            "false",
            "scale-out starts engines",
        ),
        "rollout.engine_urls": (
            str(list(r.engine_urls)),
            "[]",
            "external engines are reached through Ray actors",
        ),
        "rollout.agent": (
            "set" if r.agent is not None else "null",
            "null",
            "agent programs run beside the engine",
        ),
        "weight_transfer": (cfg.weight_transfer.name, "auto", "the roles share their tensors in memory"),
    }
    for key, (value, works, why) in needs_processes.items():
        if value != works:
            raise RelaxUserError(
                f"cluster=in_process runs every role in this process and needs {key}={works} "
                f"(got {value}: {why}); use cluster=local for this run"
            )


class SingleProcessLauncher(InProcessLauncher):
    schema = InProcessClusterConfig
    cluster: InProcessClusterConfig

    def launch(self, cfg: DictConfig, experiment: Experiment) -> Summary | None:
        check_single_process(cfg)
        return super().launch(cfg, experiment)

    def connect(self, runtime_env: dict[str, Any]) -> None:
        log.info("no Ray: every role runs in this process (cluster=in_process)")
