"""``python -m relax_launch.doctor <the same overrides as a run>``: the memory each GPU (or, on a CPU run,
each role process) will hold, per role, and whether it fits in ``cluster.gpu_memory_gb``; exit 0 when it
fits, 1 when it does not, 2 for a config that does not compose or an engine that cannot take the run's
media. Nothing is started, no weights are read."""

from __future__ import annotations

import sys

from omegaconf import OmegaConf

from relax_core.errors import RelaxUserError


def main(argv: list[str] | None = None) -> int:
    from relax_core.data.multimodal import check_engine_takes_media
    from relax_core.preflight.memory import estimate
    from relax_launch.cli import compose_config, composition_problem

    overrides = sys.argv[1:] if argv is None else argv
    problem = composition_problem(overrides)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        cfg = OmegaConf.to_object(compose_config(overrides))
        check_engine_takes_media(cfg)  # a run the launcher refuses does not "fit"
        report = estimate(cfg)
    except RelaxUserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(report.table())
    if not report.fits:
        print(f"error: memory: {report.problem()}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
