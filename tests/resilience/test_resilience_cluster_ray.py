"""``cluster=ray cluster.address=...`` attaches to a Ray cluster started outside Relax (`ray start --head`)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from resilience_helpers import TINY_RUN, read_metrics

from relax_models.ports import free_port

pytestmark = pytest.mark.slow


def _reachable(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def test_cluster_ray_attaches_to_an_existing_head(tmp_path: Path) -> None:
    port = free_port()
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    ray_bin = str(Path(sys.executable).with_name("ray"))
    # our own head in its own session, so that stopping it touches no other Ray on the machine
    head = subprocess.Popen(
        [
            ray_bin,
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--num-cpus=4",
            "--include-dashboard=false",
            "--node-ip-address=127.0.0.1",
        ],
        env=env | {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not _reachable(port):
            assert head.poll() is None, "ray start --head exited"
            assert time.monotonic() < deadline, "Ray head did not come up"
            time.sleep(0.5)
        run_dir = tmp_path / "run"
        overrides = [o for o in TINY_RUN if not o.startswith("cluster.")]
        cmd = [
            sys.executable,
            "-m",
            "relax_launch",
            "cluster=ray",
            f"cluster.address=127.0.0.1:{port}",
            *overrides,
            "trainer.total_steps=1",
            "trainer.sft_warmup_steps=0",
            f"hydra.run.dir={run_dir}",
        ]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert [r["step"] for r in read_metrics(run_dir)] == [0, 1]
        # Ray reports the head by its node IP, which may differ from the 127.0.0.1 we gave; the port is ours
        assert re.search(rf"Connecting to existing Ray cluster at address: [\d.]+:{port}\b", proc.stderr)
        assert head.poll() is None  # the run left the external cluster running
    finally:
        _stop_session(head)


def _stop_session(proc: subprocess.Popen) -> None:
    """End ``ray start --block`` and everything it started (its own session), nothing else."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(30)
            os.killpg(proc.pid, signal.SIGKILL)  # Ray processes left in the session
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            pass
        return


def test_cluster_ray_with_nothing_at_the_address_is_one_clear_error(tmp_path: Path) -> None:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "relax_launch",
        "cluster=ray",
        f"cluster.address=127.0.0.1:{port}",
        f"hydra.run.dir={tmp_path / 'run'}",
        "trainer.sft_warmup_steps=0",
        "data.num_train=16",
        "data.num_eval=4",
    ]
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert f"cluster.address='127.0.0.1:{port}'" in proc.stderr
