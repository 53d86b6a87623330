"""Which CUDA device a process uses: one answer for the roles (``relax_core.runtime.placement.role_device``) and the
default process group (``megatron.cpu_shim.init_process_group``), so the two never disagree."""

from __future__ import annotations

import os
from collections.abc import Mapping


def local_cuda_index(visible: int, env: Mapping[str, str] = os.environ) -> int:
    """Index of this process's GPU among the ``visible`` ones: ``LOCAL_RANK`` under torchrun, else 0.

    Ray narrows ``CUDA_VISIBLE_DEVICES`` to an actor's own GPUs, so the global ``RANK`` says nothing about
    which of them is its device: a rank given two GPUs uses the first, ``cuda:0``.
    """
    return int(env.get("LOCAL_RANK", 0)) % visible
