"""``cluster=ray cluster.address=...`` with no Ray there. Attaching to a cluster started outside Relax
(`ray start --head`) is what every test in ``tests/multinode/`` does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from relax_models.ports import free_port

pytestmark = pytest.mark.slow


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
