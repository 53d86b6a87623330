"""``rollout.engine=sglang``: one SGLang server per engine (GPU), driven through the shared HTTP client.

The server is SGLang's own ``python -m sglang.launch_server``; generation, pause/resume/abort and weight
updates (``/update_weights_from_disk``) go through :class:`relax_core.engines.client.HttpEngine`, the same
client our torch engine's SGLang-compatible server is tested with.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time

import httpx

from relax_core.engines.client import HttpEngine
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
    model_path: str, port: int, host: str = "127.0.0.1", extra: list[str] | None = None
) -> list[str]:
    """The ``sglang.launch_server`` command line of one engine."""
    return [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--host",
        host,
        "--port",
        str(port),
        *(extra or []),
    ]


class SGLangEngine(HttpEngine):
    """Starts an SGLang server subprocess and talks to it over its native HTTP API."""

    def __init__(
        self, model_path: str, startup_timeout_s: float = 600.0, extra_args: list[str] | None = None
    ):
        reason = sglang_unavailable_reason()
        if reason:
            raise RelaxUserError(f"rollout.engine=sglang cannot start: {reason}")
        port = free_port()
        self.process = subprocess.Popen(launch_command(model_path, port, extra=extra_args))
        super().__init__(f"http://127.0.0.1:{port}", base_model_path=model_path)
        deadline = time.monotonic() + startup_timeout_s
        while not self.health():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.shutdown()
                raise RuntimeError(f"SGLang server for {model_path} did not become healthy")
            time.sleep(2.0)

    def shutdown(self) -> None:
        try:
            super().shutdown()
        except httpx.HTTPError:
            pass
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=60)
