"""Shared fixture: a one-process gloo world for megatron's parallel state, torn down after each module
so no process group, megatron state or CPU shim leaks into other test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def megatron_world() -> Iterator[None]:
    from relax_models.megatron.cpu_shim import disable_cpu_shim, init_process_group
    from relax_models.ports import free_port

    init_process_group(rank=0, world_size=1, port=free_port())
    yield
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    disable_cpu_shim()
