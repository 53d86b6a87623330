"""compose (Hydra) -> validate -> pick the ``cluster`` launcher -> it runs the experiment -> report."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from relax_core.preflight.validation import validate
from relax_launch.cluster import launcher_for
from relax_launch.experiment import Summary, quiet_third_parties, report, run_experiment_on_ray


def run_experiment(cfg: DictConfig) -> Summary | None:
    """Run one experiment on the cluster ``cfg.cluster`` names and return its summary (also written to
    summary.json; None when a submitted Slurm job is not waited for)."""
    quiet_third_parties()
    config = OmegaConf.to_object(cfg)  # typed RelaxConfig with every interpolation resolved
    validate(config)
    summary = launcher_for(config.cluster).launch(cfg, run_experiment_on_ray)
    report(summary)
    return summary
