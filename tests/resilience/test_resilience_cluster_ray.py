"""``cluster=ray cluster.address=...`` with no Ray there. Attaching to a cluster started outside Relax
(`ray start --head`) is what every test in ``tests/multinode/`` does."""

from __future__ import annotations

from pathlib import Path

import launching
import pytest

from relax_models.ports import free_port

pytestmark = pytest.mark.slow


def test_cluster_ray_with_nothing_at_the_address_is_one_clear_error(tmp_path: Path) -> None:
    port = free_port()
    proc = launching.launch(
        tmp_path / "run",
        "cluster=ray",
        f"cluster.address=127.0.0.1:{port}",
        "trainer.sft_warmup_steps=0",
        "data.num_train=16",
        "data.num_eval=4",
        env=launching.RAY_NO_AUTH,
        cwd=tmp_path,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 2
    assert f"cluster.address='127.0.0.1:{port}'" in proc.stderr
