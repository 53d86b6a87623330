"""Which tests of a module this session runs: module fixtures that start slow work early (a server, a run)
start it only for tests that will use it."""

from __future__ import annotations

import pytest


def selected(request: pytest.FixtureRequest, test_name: str) -> list[pytest.Item]:
    """The collected items of ``request``'s module whose test function is ``test_name`` (every parametrized
    case of it)."""
    return [
        item
        for item in request.session.items
        if item.module is request.module and getattr(item, "originalname", item.name) == test_name
    ]
