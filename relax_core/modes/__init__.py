"""Execution modes: schedulers over the same role classes (``mode=colocate`` | ``mode=async``)."""

from __future__ import annotations

from relax_core.config.options import Option
from relax_core.modes.base import Mode, RoleGroups, RunContext

MODES = Option(
    "mode.name",
    {
        "colocate": "relax_core.modes.colocate:ColocateMode",
        "async": "relax_core.modes.asynchronous:AsyncMode",
    },
)


def build_mode(ctx: RunContext) -> Mode:
    """The scheduler ``mode.name`` names."""
    return MODES.load(ctx.cfg.mode.name)(ctx)


__all__ = ["MODES", "Mode", "RoleGroups", "RunContext", "build_mode"]
