"""One tensor-parallel worker of an SGLang server, for tests: it joins and receives with SGLang's own code.

``python sglang_tp_worker.py SGLANG_ROOT OUT_DIR TP_RANK TP_SIZE TP_PORT`` forms the workers' own default
group (as SGLang's TP workers do), then answers one JSON request per stdin line (``{"path", "body"}`` as the
server's HTTP endpoint receives it) with one ``{"success", "message"}`` line:

- ``/init_weights_update_group``: SGLang's ``WeightUpdater.init_weights_update_group`` (which calls its
  ``init_custom_process_group``);
- ``/update_weights_from_distributed``: SGLang's ``WeightUpdater.receive_weights_from_distributed``, the
  received ``(name, tensor)`` list saved to ``OUT_DIR/rank<TP_RANK>-<n>.pt`` for the test to check; refused
  outside a ``/begin_weight_update`` ... ``/end_weight_update`` session, as SGLang 0.5.23's scheduler
  (``scheduler_components/weight_updater.py``) refuses it.

SGLang's modules import CUDA-only packages, so those functions (and the helpers they call) are compiled
from the installed package's source files, not re-typed here.
"""

from __future__ import annotations
import __future__

import ast
import ipaddress
import json
import logging
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
from packaging import version as pkg_version

# file (under sglang/) -> top-level names taken from it; "Class.method" takes one method as a function
SOURCES = {
    "srt/utils/common.py": ["torch_release", "init_custom_process_group"],
    "srt/utils/network.py": ["_is_ipv6", "_wrap", "NetworkAddress"],
    "srt/model_executor/model_runner_components/weight_updater.py": [
        "WeightUpdater.init_weights_update_group",
        "WeightUpdater.receive_weights_from_distributed",
    ],
}


def _defined(node: ast.stmt) -> str | None:
    if isinstance(node, ast.FunctionDef | ast.ClassDef):
        return node.name
    if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    return None


def sglang_code(root: Path) -> dict[str, Any]:
    """The functions of ``SOURCES``, compiled from SGLang's files into one module (the imports they need
    provided), as SGLang's modules would define them."""
    module = ModuleType("sglang_source")
    sys.modules[module.__name__] = module  # dataclass() looks its class's module up there
    namespace = module.__dict__
    namespace |= {
        "torch": torch,
        "pkg_version": pkg_version,
        "logger": logging.getLogger("sglang"),
        "ipaddress": ipaddress,
        "socket": socket,
        "dataclass": dataclass,
    }
    for rel, names in SOURCES.items():
        path = root / rel
        tree = ast.parse(path.read_text(), str(path))
        nodes: list[ast.stmt] = []
        for name in names:
            owner, _, method = name.partition(".")
            (node,) = [n for n in tree.body if _defined(n) == owner]
            if method:
                (node,) = [m for m in node.body if isinstance(m, ast.FunctionDef) and m.name == method]
            nodes.append(node)
        # the files' own ``from __future__ import annotations``: annotations stay unevaluated strings
        flags = __future__.annotations.compiler_flag
        source = ast.Module(body=nodes, type_ignores=[])
        exec(compile(source, str(path), "exec", flags=flags, dont_inherit=True), namespace)
    return namespace


def main(root: str, out_dir: str, tp_rank: str, tp_size: str, tp_port: str) -> None:
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything else printed goes to stderr: stdout carries only the replies
    code = sglang_code(Path(root))
    rank = int(tp_rank)
    # SGLang's WeightUpdater asserts the TP workers' default group exists
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{tp_port}", world_size=int(tp_size), rank=rank
    )
    worker = SimpleNamespace(tp_rank=rank, device="cpu", _model_update_group={})
    received = 0
    session = False  # SGLang's scheduler takes weight updates only inside a begin/end session
    for line in sys.stdin:
        request = json.loads(line)
        body = request["body"]
        if request["path"] == "/init_weights_update_group":
            success, message = code["init_weights_update_group"](worker, **body)
        elif request["path"] in ("/begin_weight_update", "/end_weight_update"):
            opening = request["path"] == "/begin_weight_update"
            success, message = session != opening, "session " + ("opened" if opening else "closed")
            session = opening
        elif not session:  # refused before receiving, as the scheduler does: the broadcast would hang
            success, message = False, "update_weights_from_distributed must run between begin and end"
        else:
            fields = ("names", "dtypes", "shapes", "group_name")
            weights = code["receive_weights_from_distributed"](worker, **{k: body[k] for k in fields})
            torch.save(weights, Path(out_dir) / f"rank{rank}-{received:03d}.pt")
            received += 1
            success, message = True, "received"
        replies.write(json.dumps({"success": success, "message": message}) + "\n")
        replies.flush()


if __name__ == "__main__":
    main(*sys.argv[1:])
