"""``rollout.engine=sglang``: one SGLang server per engine (GPU), driven through the shared HTTP client.

The server is SGLang's own ``python -m sglang.launch_server`` with the run's seed, dtype, tensor-parallel
size and memory fraction; generation, pause/resume/abort and weight updates go through
:class:`relax_core.engines.client.HttpEngine`, the client our torch engine's server and Relax's vLLM server
are tested with. Weights move in memory (SGLang's ``/init_weights_update_group`` +
``/update_weights_from_distributed``) unless ``rollout.server_weight_update=disk``. The engine serves the base
model's weights (SGLang's version ``"default"``, read as 0) until the first update.
"""

from __future__ import annotations

import importlib.util
import sys

from relax_core.config import RolloutConfig
from relax_core.engines.base import engine_dtype
from relax_core.engines.server_process import ServerEngine, ServerProcess, check_server_weight_update
from relax_core.errors import RelaxUserError
from relax_models.ports import free_port


def sglang_unavailable_reason() -> str | None:
    """Why SGLang cannot run here (None when it can)."""
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed (pip install 'relax[sglang]' on a GPU machine)"
    import torch

    if not torch.cuda.is_available():
        return "SGLang's runtime needs a CUDA GPU"
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
) -> list[str]:
    """The ``sglang.launch_server`` command line of one engine."""
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path]
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
    ):
        reason = sglang_unavailable_reason()
        if reason:
            raise RelaxUserError(f"rollout.engine=sglang cannot start: {reason}")
        check_server_weight_update(weight_transfer)
        port = free_port()
        server = ServerProcess(
            launch_command(
                model_path,
                port,
                extra=extra_args,
                seed=seed,
                dtype=dtype,
                tensor_parallel_size=tensor_parallel_size,
                memory_fraction=memory_fraction,
            )
        )
        super().__init__(
            server, port, model_path, weight_transfer, tensor_parallel_size, "SGLang", startup_timeout_s
        )

    @classmethod
    def from_config(cls, model_path: str, seed: int, rollout_cfg: RolloutConfig | None) -> SGLangEngine:
        """The engine ``rollout.*`` describes (``conf/rollout/sglang.yaml``)."""
        r = rollout_cfg if rollout_cfg is not None else RolloutConfig()
        return cls(
            model_path,
            seed=seed,
            dtype=str(engine_dtype(r.dtype)).removeprefix("torch."),
            tensor_parallel_size=r.tensor_parallel_size,
            memory_fraction=r.memory_fraction,
            weight_transfer=r.server_weight_update,
        )
