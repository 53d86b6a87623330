"""Eval-only runs: ``python -m relax_launch.eval model.path=<folder> [overrides]`` scores a model on the eval
sets (``eval.sets``) without training, on the same modes, engines and clusters as a training run.

``model.path`` is a Hugging Face folder (a run's ``final_model`` is one) or a run's checkpoint
(``<run dir>/checkpoints/step_N``): the model that run started from is loaded, then the checkpoint's weights.
The run dir gets ``eval_metrics.jsonl`` (one JSON line per set) and ``eval_results.json``.
"""

from __future__ import annotations

import json
import logging
import sys
from functools import partial
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from relax_core.errors import RelaxUserError
from relax_launch.cli import CONFIG_MODULE, check_schema, exit_on_bad_overrides
from relax_launch.experiment import QUIET_ENV, Connect, Summary, quiet_third_parties

log = logging.getLogger("relax")


def checkpoint_model(path: str) -> tuple[str, str] | None:
    """(model folder, checkpoint) when ``path`` is a run's checkpoint folder, else None. The model folder is
    the one the run started from: its ``model_init`` (a built tiny model), else its config's model.path."""
    ckpt = Path(path).expanduser()
    if not (ckpt / "driver.pt").is_file():
        return None
    run_dir = ckpt.parent.parent  # <run dir>/checkpoints/step_N
    if (run_dir / "model_init" / "config.json").is_file():
        return str(run_dir / "model_init"), str(ckpt)
    config = run_dir / "config.yaml"
    start = OmegaConf.load(config).model.path if config.is_file() else None
    if not start:
        raise RelaxUserError(
            f"model.path={path!r} is a checkpoint, but its run dir {run_dir} has neither model_init/ nor a "
            "config.yaml naming model.path: give the model folder the run started from"
        )
    return str(start), str(ckpt)


def evaluate_experiment(cfg: DictConfig, connect: Connect, checkpoint: str | None = None) -> Summary:
    """Load the model and the eval sets, bring up the cluster's roles, score every set, tear down."""
    quiet_third_parties()
    config = OmegaConf.to_object(cfg)
    from relax_core.run_loop import RunLoop

    loop = RunLoop(config, OmegaConf.to_container(cfg, resolve=True))
    Path(config.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(config.output_dir) / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    connect({"env_vars": QUIET_ENV})
    try:
        return loop.evaluate_only(checkpoint)
    finally:
        ray = sys.modules.get("ray")
        if ray is not None:
            ray.shutdown()


@hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    from relax_core.preflight.validation import validate
    from relax_launch.cluster import launcher_for

    try:
        check_schema(cfg)
        cfg.output_dir = HydraConfig.get().runtime.output_dir
        found = checkpoint_model(cfg.model.path) if cfg.model.path else None
        if found is not None:
            cfg.model.path = found[0]
        config = OmegaConf.to_object(cfg)
        validate(config)
        results = launcher_for(config.cluster).launch(
            cfg, partial(evaluate_experiment, checkpoint=found[1] if found else None)
        )
    except RelaxUserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    if results:
        for name, metrics in results["sets"].items():
            log.info("eval %s: %s", name, json.dumps(metrics))
        log.info("results: %s/eval_results.json", results["output_dir"])


def main() -> None:
    exit_on_bad_overrides(sys.argv[1:])
    _hydra_main()


if __name__ == "__main__":
    main()
