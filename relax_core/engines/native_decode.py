"""The torch engine's fused decode kernels (``decode_kernels.cpp``), compiled on first use.

``rollout.native_kernels=true`` turns them on. The first engine on a machine builds them with the host's C++
compiler through ``torch.utils.cpp_extension`` (ATen and torch's pybind casters only, not the whole C++
frontend of ``torch/extension.h``: a first run waits on it); later ones load the build from
``~/.cache/torch_extensions`` (``TORCH_EXTENSIONS_DIR``). The build targets the widest vector ISA torch
itself dispatches to on this CPU, and that ISA is part of the extension's name, so machines of different
CPUs sharing a home directory each get their own build.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path
from types import ModuleType

from relax_core.errors import RelaxUserError

SOURCE = Path(__file__).with_name("decode_kernels.cpp")
KERNEL_HEAD_DIMS = (32, 64, 128)  # the head sizes decode_attention is compiled for
KERNEL_MAX_GROUP = 16  # query heads per KV head (kMaxGroup)
# vectorised reductions need reassociation; NaN/inf semantics stay IEEE (no -ffast-math)
FLAGS = [
    "-O3",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-signed-zeros",
    "-fassociative-math",
]
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}


@functools.cache
def decode_kernels() -> ModuleType:
    """The compiled kernels; a :class:`RelaxUserError` naming what is missing when they cannot be built."""
    import ninja
    import torch
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # a venv's python run without activating the venv
        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise RelaxUserError(
            "rollout.native_kernels=true needs a C++ compiler (c++ or $CXX on PATH); none found"
        )
    isa = torch.backends.cpu.get_cpu_capability()
    try:
        return cpp_extension.load(
            name=f"relax_decode_kernels_{isa.lower()}",
            sources=[str(SOURCE)],
            extra_cflags=FLAGS + ISA_FLAGS.get(isa, []),
            extra_ldflags=["-fopenmp"],
        )
    except Exception as err:  # the compiler's own message says what failed
        raise RelaxUserError(f"rollout.native_kernels=true: building {SOURCE.name} failed: {err}") from err
