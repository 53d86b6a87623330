"""An engine server subprocess (vLLM, SGLang) in its own process group: started, waited on until healthy,
and stopped with every child it spawned (vLLM's engine core, SGLang's schedulers): no orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from relax_core.engines.client import HttpEngine
from relax_core.errors import RelaxUserError


class ServerProcess:
    def __init__(self, command: list[str], env: dict[str, str] | None = None, cwd: str | None = None) -> None:
        self.command = command
        # its log goes to our stderr: stdout stays the caller's (benchmarks print JSON lines there)
        self.popen = subprocess.Popen(command, env=env, cwd=cwd, start_new_session=True, stdout=2)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_healthy(self, healthy: Callable[[], bool], what: str, timeout_s: float) -> None:
        """Poll ``healthy`` until it holds; stop the group and raise when the server exits or times out."""
        deadline = time.monotonic() + timeout_s
        while not healthy():
            if not self.alive() or time.monotonic() > deadline:
                code = self.popen.poll()
                self.stop()
                raise RuntimeError(
                    f"{what} did not become healthy (exit code {code}): {' '.join(self.command)}"
                )
            time.sleep(1.0)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL whatever is left after ``grace_s``; return once every member has
        exited (a killed process on a loaded machine can take seconds to go) and the leader is reaped."""
        self._signal(signal.SIGTERM)
        if not self._wait_gone(grace_s):
            self._signal(signal.SIGKILL)
            self._wait_gone(60.0)
        self.popen.wait(timeout=30)

    def _wait_gone(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while group_members(self.popen.pid):
            self.popen.poll()  # reap the leader: a zombie is not a member
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass


def has_package(python: str, package: str) -> bool:
    """Whether the interpreter ``python`` finds ``package`` (looked up, not imported)."""
    probe = subprocess.run(
        [
            python,
            "-c",
            f"import importlib.util, sys; sys.exit(importlib.util.find_spec({package!r}) is None)",
        ],
        capture_output=True,
    )
    return probe.returncode == 0


def python_with(package: str, chosen: str, hint: str) -> str:
    """``chosen`` when it is a Python that has ``package`` (an engine's own interpreter: vLLM and SGLang pin
    their own torch); a RelaxUserError naming the cause and ``hint`` otherwise."""
    if not Path(chosen).exists():
        raise RelaxUserError(f"rollout.engine={package} cannot start: no Python at {chosen}; {hint}")
    if not has_package(chosen, package):
        raise RelaxUserError(f"rollout.engine={package} cannot start: {chosen} has no {package}; {hint}")
    return chosen


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``, from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


class ServerEngine(HttpEngine):
    """An :class:`HttpEngine` whose server is a child process this engine started (vLLM, SGLang): healthy
    while the process lives and answers; shutdown stops the whole process group."""

    def __init__(
        self,
        server: ServerProcess,
        port: int,
        model_path: str,
        weight_transfer: str,
        server_world_size: int,
        what: str,
        startup_timeout_s: float,
    ) -> None:
        self.server = server
        super().__init__(
            f"http://127.0.0.1:{port}",
            base_model_path=model_path,
            weight_transfer=weight_transfer,
            server_world_size=server_world_size,
        )
        server.wait_healthy(super().health, f"{what} server for {model_path}", startup_timeout_s)

    def health(self) -> bool:
        return self.server.alive() and super().health()

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self.server.stop()
