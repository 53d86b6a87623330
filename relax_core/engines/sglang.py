"""``rollout.engine=sglang``: one SGLang server per engine (GPU), driven through the shared HTTP client.

The server is SGLang's own ``python -m sglang.launch_server`` with the run's seed, dtype, tensor-parallel
size and memory fraction; generation, pause/resume/abort and weight updates go through
:class:`relax_core.engines.client.HttpEngine`, the client our torch engine's server and Relax's vLLM server
are tested with. Weights move in memory (SGLang's ``/init_weights_update_group`` +
``/update_weights_from_distributed``) unless ``rollout.server_weight_update=disk``. The engine serves the base
model's weights (SGLang's version ``"default"``, read as 0) until the first update.

SGLang pins its own torch (sglang 0.5.23: torch 2.14.1), so it lives in a venv of its own
(``bash scripts/install_sglang.sh`` on a GPU machine). The interpreter is ``rollout.sglang_python``, else
``$RELAX_SGLANG_PYTHON``, else the install script's venv (``$RELAX_SGLANG_VENV`` or
``~/.cache/relax/sglang-0.5.23``), else this Python when it has SGLang.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from relax_core.engines.base import EngineSetup, default_memory_fraction, engine_dtype
from relax_core.engines.server_process import (
    ServerEngine,
    ServerProcess,
    python_with,
)
from relax_core.errors import RelaxUserError
from relax_core.weight_transfer.server_push import SERVER_PUSHES
from relax_models.ports import free_port

SGLANG_VERSION = "0.5.23"  # scripts/install_sglang.sh installs the same
DEFAULT_VENV = Path.home() / ".cache" / "relax" / f"sglang-{SGLANG_VERSION}"
INSTALL_HINT = "install it with `bash scripts/install_sglang.sh` (GPU machine) or set rollout.sglang_python=/path/to/bin/python"


def sglang_python(configured: str | None = None) -> str:
    """The Python that runs SGLang's server; RelaxUserError naming the cause when there is none."""
    explicit = configured or os.environ.get("RELAX_SGLANG_PYTHON")
    default = Path(os.environ.get("RELAX_SGLANG_VENV", DEFAULT_VENV)) / "bin" / "python"
    if not explicit and not default.exists() and importlib.util.find_spec("sglang") is not None:
        return sys.executable  # SGLang installed in the project's own venv
    return python_with("sglang", explicit or str(default), INSTALL_HINT)


def sglang_unavailable_reason(configured: str | None = None) -> str | None:
    """Why SGLang cannot run here (None when it can)."""
    try:
        sglang_python(configured)
    except RelaxUserError as err:
        return str(err)
    return _no_gpu_reason()


def _no_gpu_reason() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "rollout.engine=sglang cannot start: SGLang's runtime needs a CUDA GPU"
    return None


def launch_command(
    model_path: str,
    port: int,
    host: str = "127.0.0.1",
    extra: list[str] | None = None,
    seed: int = 0,
    dtype: str = "auto",
    tensor_parallel_size: int = 1,
    memory_fraction: float | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The ``sglang.launch_server`` command line of one engine, run by ``python``."""
    command = [python, "-m", "sglang.launch_server", "--model-path", model_path]
    command += ["--host", host, "--port", str(port), "--random-seed", str(seed), "--dtype", dtype]
    command += ["--tp-size", str(tensor_parallel_size)]
    if memory_fraction is not None:
        command += ["--mem-fraction-static", str(memory_fraction)]
    return command + list(extra or [])


class SGLangEngine(ServerEngine):
    """Starts an SGLang server subprocess and talks to it over its native HTTP API."""

    def __init__(
        self,
        model_path: str,
        startup_timeout_s: float = 600.0,
        extra_args: list[str] | None = None,
        seed: int = 0,
        dtype: str = "auto",
        tensor_parallel_size: int = 1,
        memory_fraction: float | None = None,
        weight_transfer: str = "distributed",
        python: str | None = None,
        release_memory: bool = False,
    ):
        """``release_memory`` (``rollout.release_memory_during_train``): start the server with
        ``--enable-memory-saver``, which ``/release_memory_occupation`` needs."""
        python = sglang_python(python)
        reason = _no_gpu_reason()
        if reason:
            raise RelaxUserError(reason)
        SERVER_PUSHES.load(weight_transfer)  # before the server starts
        port = free_port()
        server = ServerProcess(
            launch_command(
                model_path,
                port,
                extra=list(extra_args or []) + (["--enable-memory-saver"] if release_memory else []),
                seed=seed,
                dtype=dtype,
                tensor_parallel_size=tensor_parallel_size,
                memory_fraction=memory_fraction,
                python=python,
            )
        )
        super().__init__(
            server, port, model_path, weight_transfer, tensor_parallel_size, "SGLang", startup_timeout_s
        )

    @classmethod
    def from_config(cls, setup: EngineSetup) -> SGLangEngine:
        """The engine ``rollout.*`` describes (``conf/rollout/sglang.yaml``); the server loads its own model
        and tokenizer from ``setup.model_path``."""
        r, model_path, seed = setup.rollout_config(), setup.model_path, setup.seed
        return cls(
            model_path,
            seed=seed,
            dtype=str(engine_dtype(r.dtype)).removeprefix("torch."),
            tensor_parallel_size=r.tensor_parallel_size,
            memory_fraction=r.memory_fraction
            if r.memory_fraction is not None
            else default_memory_fraction(r.num_gpus),
            weight_transfer=r.server_weight_update,
            python=r.sglang_python,
            release_memory=r.release_memory_during_train,
        )
