"""The twin accelerator (``twin_device.cpp``): torch's PrivateUse1 device, named ``twin``, whose memory is
host memory and whose kernels are the CPU's, and the ``twin`` process-group backend that serves it alone.

Why it is strict: on a GPU node the training groups are NCCL groups, and NCCL serves CUDA tensors only; a
CPU tensor handed to one fails ("No backend type associated with device type cpu"). On a CPU-only machine
the model's device *is* the CPU and gloo serves it, so no such mistake shows. Here the model lives on a
second device type that computes exactly like the CPU, and the default group's only backend serves that
device: a collective on a CPU tensor fails in torch's own dispatch, with NCCL's error, while collectives on
twin tensors run gloo on the same memory (bit-identical results).
"""

from __future__ import annotations

import functools
import os
import shutil
import types
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

SOURCE = Path(__file__).with_name("twin_device.cpp")
DEVICE = "twin"


@functools.cache
def load() -> types.ModuleType:
    """Build (once per machine, cached in ``~/.cache/torch_extensions``) and register the ``twin`` device
    and the ``twin`` process-group backend; returns the extension."""
    import ninja
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # a venv's python run without activating the venv
        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    ext = cpp_extension.load(name="relax_twin_device", sources=[str(SOURCE)], extra_cflags=["-O1"])
    torch.utils.rename_privateuse1_backend(DEVICE)
    torch._register_device_module(DEVICE, _device_module())
    torch.utils.generate_methods_for_privateuse1_backend()

    def create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.Backend:
        return ext.TwinBackend(dist.ProcessGroupGloo(store, rank, size, timeout))

    dist.Backend.register_backend(DEVICE, create, devices=[DEVICE])
    return ext


def _device_module() -> types.ModuleType:
    """``torch.twin``: what FSDP2 and DeviceMesh ask of a device module (streams, events, the current
    device). The twin runs every kernel synchronously on the host, so torch.cpu's no-op streams fit."""
    module = types.ModuleType(f"torch.{DEVICE}")
    for name in ("Event", "StreamContext", "stream", "synchronize"):
        setattr(module, name, getattr(torch.cpu, name))
    module.Stream = _Stream
    module.current_stream = lambda device=None: _Stream()
    # random ops run as the CPU's kernels, on the CPU generator (torch.manual_seed seeds it)
    module._is_in_bad_fork = lambda: False
    module.manual_seed = module.manual_seed_all = lambda seed: None
    module.is_available = lambda: True
    module.is_initialized = lambda: True
    module.device_count = lambda: 1
    module.current_device = lambda: 0
    module.set_device = lambda device: None
    return module


class _Stream(torch.cpu.Stream):
    """A stream whose work is always done (the twin computes synchronously)."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True
