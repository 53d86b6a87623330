"""Relax's in-memory weight push into SGLang's own weight-group code (a strict CPU twin of the GPU path).

An SGLang server's TP workers join the group with SGLang's ``init_custom_process_group`` and receive with
its ``receive_weights_from_distributed``; ``sglang_tp_worker.py`` runs exactly those functions, compiled
from the installed SGLang package (``scripts/install_vllm_cpu.sh --sglang-schemas``), in two subprocesses
with their own default group. Relax's real ``DistributedPush`` pushes a state dict over gloo and every
tensor is checked where it arrives. Relax's vLLM worker extension joins with the same ``join_group``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from test_sglang_schemas import ROOT

from relax_core.weight_transfer import server_push
from relax_core.weight_transfer.server_push import DistributedPush
from relax_models.ports import free_port

WORKER = Path(__file__).with_name("sglang_tp_worker.py")


@pytest.mark.gpu_twin
@pytest.mark.skipif(
    ROOT is None, reason="SGLang's package is not installed (install_vllm_cpu.sh --sglang-schemas)"
)
def test_sglang_group_code_receives_relax_weight_push(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a group that cannot form fails in seconds, not after the production 300 s
    monkeypatch.setattr(server_push, "GROUP_TIMEOUT", timedelta(seconds=20))
    tp_port = free_port()
    workers = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(ROOT), str(tmp_path), str(rank), "2", str(tp_port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]

    def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
        """The server: each request goes to every TP worker, as SGLang's scheduler fans it out."""
        for worker in workers:
            worker.stdin.write(json.dumps({"path": path, "body": body}) + "\n")
            worker.stdin.flush()
        replies = [
            json.loads(w.stdout.readline() or '{"success": false, "message": "exited"}') for w in workers
        ]
        return {
            "success": all(r["success"] for r in replies),
            "message": "; ".join(r["message"] for r in replies),
        }

    state = {
        "model.embed_tokens.weight": torch.randn(3, 4),
        "model.norm.weight": torch.arange(5, dtype=torch.bfloat16),
        "lm_head.weight": torch.tensor([[1, -2], [3, 4]], dtype=torch.int64),
    }
    try:
        # one bucket per dtype: three requests, the last carrying the version
        push = DistributedPush(post, server_world_size=2, bucket_mb=64 / 2**20)
        push.push(state, version=1)
        push.close()
        for rank in range(2):
            received = [item for f in sorted(tmp_path.glob(f"rank{rank}-*.pt")) for item in torch.load(f)]
            assert [name for name, _ in received] == list(state)
            for name, tensor in received:
                assert tensor.dtype == state[name].dtype and torch.equal(tensor, state[name]), name
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
