"""The Hydra entry point. ``python -m relax_launch [overrides]`` lands here."""

from __future__ import annotations

import atexit
import dataclasses
import gc
import logging
import sys
from typing import NoReturn

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from relax_core.config.schema import RelaxConfig
from relax_core.errors import RelaxUserError, disk_full
from relax_core.resilience.health import RunFailedError
from relax_launch.cluster import LAUNCHERS
from relax_launch.sweep import optimising_sweep, sweep_objective

CONFIG_MODULE = "relax_launch.conf"
ConfigStore.instance().store(name="relax_schema", node=RelaxConfig)
# each cluster option's own schema, in no group (--help lists only the options);
# conf/cluster/<name>.yaml extends ``/cluster_<name>_schema``
for _name, _launcher in LAUNCHERS.items():
    ConfigStore.instance().store(name=f"cluster_{_name}_schema", node=_launcher.schema)
log = logging.getLogger("relax")


@hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> float | None:
    """Run one experiment; a point of an optimising sweep returns its ``sweep_metric`` to the sweeper."""
    from relax_launch.run import run_experiment

    try:
        check_schema(cfg)
    except RelaxUserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    cfg.output_dir = HydraConfig.get().runtime.output_dir
    if optimising_sweep():
        return _sweep_point(cfg)
    try:
        run_experiment(cfg)
    except RelaxUserError as err:
        _fail(str(err))
    except RunFailedError as err:  # restarts exhausted; the full report is in <run dir>/failure_report.json
        print(f"error: run failed: {str(err).splitlines()[0]}", file=sys.stderr)
        sys.exit(1)
    except (
        Exception
    ) as err:  # a full disk surfaces from any writer (torch, Ray, MLflow): one line, not theirs
        full = disk_full(err, cfg.output_dir)
        if full is None:
            raise
        _fail(str(full))


def _sweep_point(cfg: DictConfig) -> float | None:
    """One trial: its ``sweep_metric``, or None when the run fails, which the sweeper records as a failed
    trial before it goes on (relax_launch/sweep.py; an exception or an exit would end the whole search)."""
    from relax_launch.run import run_experiment

    try:
        summary = run_experiment(cfg)
    except (RelaxUserError, RunFailedError) as err:
        log.error("sweep point %s failed: %s", cfg.output_dir, str(err).splitlines()[0])
        return None
    except Exception:  # noqa: BLE001  (any crash of one point is that trial's failure)
        log.exception("sweep point %s failed", cfg.output_dir)
        return None
    return sweep_objective(summary, cfg.sweep_metric)


def _fail(message: str) -> NoReturn:
    """Exit 2 with one line on stderr; the run dir's log (``cli.log``) records it too, but the console,
    where Hydra's handler would print it a second time, does not."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "error: %s", (message,), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def unknown_keys(node: DictConfig, schema: DictConfig, prefix: str = "") -> list[str]:
    """Keys of ``node`` that its dataclass schema lacks (free-form dict fields are not checked)."""
    found = []
    for key in node.keys():
        name = f"{prefix}{key}"
        if key not in schema:
            found.append(name)
            continue
        child, ref = node._get_node(key), schema._get_node(key)
        if isinstance(child, DictConfig) and isinstance(ref, DictConfig):
            # a dataclass field that defaults to null (model.tiny, algorithm.critic) or an option's own
            # subclass (cluster=slurm): check the node against its own dataclass, else a typo under it is
            # silently dropped by OmegaConf.to_object
            child_type = OmegaConf.get_type(child)
            if dataclasses.is_dataclass(child_type) and child_type is not OmegaConf.get_type(ref):
                ref = OmegaConf.structured(child_type)
        if (
            isinstance(child, DictConfig)
            and isinstance(ref, DictConfig)
            and OmegaConf.get_type(ref) not in (dict, None)
        ):
            found += unknown_keys(child, ref, name + ".")
    return found


def check_schema(cfg: DictConfig) -> None:
    """Fail on keys the schema lacks: ``+group.key=...`` opens Hydra's struct flag and would slip through."""
    extra = unknown_keys(cfg, OmegaConf.structured(RelaxConfig))
    if extra:
        raise RelaxUserError(f"{extra[0]}: not a field of the config schema (relax_core/config/schema.py)")


def compose_config(overrides: list[str]) -> DictConfig:
    """The config ``python -m relax_launch <overrides>`` runs, schema-checked; raises on a bad override."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    check_schema(cfg)
    return cfg


def composition_problem(overrides: list[str]) -> str | None:
    """One line naming what is wrong with ``overrides``, or None when the config composes."""
    try:
        compose_config(overrides)
    except Exception as err:  # noqa: BLE001  (Hydra and OmegaConf raise many types; all are user errors)
        if isinstance(err, RelaxUserError):
            return str(err)
        cause = err.__cause__
        if cause is not None and getattr(cause, "full_key", None):
            return f"{cause.full_key}: {str(cause).splitlines()[0]}"
        lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
        lines = lines[
            : next((i for i, ln in enumerate(lines) if ln.startswith("Config search path")), len(lines))
        ]
        return "; ".join(lines)
    return None


def exit_on_bad_overrides(args: list[str]) -> None:
    """Plain invocations get a one-line message (exit 2) for a bad override; flagged ones (--cfg, -m,
    --help, ...) go to Hydra untouched."""
    if args and not any(a.startswith("-") for a in args):
        problem = composition_problem(args)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            sys.exit(2)


def main() -> None:
    # The interpreter's final garbage collection walks torch's, transformers' and Ray's object graphs
    # (~2 s on 2 cores); frozen objects are skipped and the OS frees them with the process. Registered
    # before the run, so it runs after the exit handlers the run registers (Ray's shutdown).
    atexit.register(gc.freeze)
    exit_on_bad_overrides(sys.argv[1:])
    _hydra_main()
