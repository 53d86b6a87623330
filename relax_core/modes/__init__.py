"""Execution modes: schedulers over the same role classes (``mode=colocate`` | ``mode=async``)."""

from __future__ import annotations

from relax_core.modes.base import Mode, RoleGroups, RunContext


def build_mode(ctx: RunContext) -> Mode:
    """The scheduler ``mode.name`` names."""
    if ctx.cfg.mode.name == "async":
        from relax_core.modes.asynchronous import AsyncMode

        return AsyncMode(ctx)
    from relax_core.modes.colocate import ColocateMode

    return ColocateMode(ctx)


__all__ = ["Mode", "RoleGroups", "RunContext", "build_mode"]
