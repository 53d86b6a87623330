"""Fixtures of the async-mode tests: one local Ray cluster per test module (shut down after it)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
from tiers import heavy


@pytest.fixture(scope="module")
@heavy("starts a local Ray")
def ray_cluster() -> Iterator[None]:
    """A fresh local Ray with 6 logical CPUs (TransferQueue reserves 2 of them; the actors are light)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    # test modules are not importable in Ray workers: ship their classes by value
    from ray import cloudpickle

    for name in ("test_databus", "test_weight_transfer"):
        if name in sys.modules:
            cloudpickle.register_pickle_by_value(sys.modules[name])
    ray.init(address="local", num_cpus=6, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
