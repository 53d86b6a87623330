"""``rollout.engine=vllm`` for real: Relax's vLLM server (vllm-cpu in its own venv, started by
:class:`VLLMEngine`) against HF greedy decoding, the trainer's log-prob recomputation, weight pushes over a
gloo group and from disk, abort / pause / resume, and a SIGKILLed server.

One server per module (vLLM starts in ~25 s); the SIGKILL test comes last and takes it down. The MoE test's
tensor-parallel server starts alongside it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from engine_helpers import check_ignore_eos
from engine_helpers import reqs as requests
from safetensors import safe_open
from selection import selected
from tiers import heavy

from relax_core.algorithms.logprobs import token_logprobs_and_entropy
from relax_core.config.schema import ModelConfig, RolloutConfig
from relax_core.engines import build_engine
from relax_core.engines.base import EngineSetup, GenerationRequest, SamplingParams, default_memory_fraction
from relax_core.engines.server_process import group_members
from relax_core.engines.vllm import (
    VLLMEngine,
    logprobs_mode,
    max_model_len,
    vllm_dtype,
    vllm_python,
    vllm_unavailable_reason,
)
from relax_core.errors import RelaxUserError
from relax_core.samples import Sample, TrainBatch
from relax_core.weight_transfer.server_push import DistributedPush, FolderPush
from relax_models.loader import load_causal_lm, load_tokenizer

REASON = vllm_unavailable_reason()
# CI installs vLLM (tests/run.sh): there a missing install is a failure, not a skip
needs_vllm = pytest.mark.skipif(
    REASON is not None and not os.environ.get("RELAX_REQUIRE_VLLM"), reason=str(REASON)
)


@pytest.fixture(scope="module")
@heavy("starts a vLLM server")
def engine(request: pytest.FixtureRequest, tiny_model_dir: Path):
    # start the MoE test's server now, in the background, when it will run: each start is mostly one
    # process's Python start-up at a time, so the two overlap on a CPU machine (on a GPU both would ask for
    # 0.85 of its memory)
    if not torch.cuda.is_available() and selected(request, MOE_TEST):
        request.getfixturevalue("moe_engine")
    engine = VLLMEngine(str(tiny_model_dir), seed=0, dtype="float32", kv_cache_mib=64)
    yield engine
    engine.shutdown()


@torch.no_grad()
def hf_greedy(model, ids: list[int], steps: int, eos: int) -> list[int]:
    """HF ``generate`` argmax decoding, EOS included as the engines report it."""
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=steps, eos_token_id=eos)
    new = out[0, len(ids) :].tolist()
    return new[: new.index(eos) + 1] if eos in new else new


def perturbed_state(model, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return model.state_dict()


def test_missing_vllm_is_one_clear_error(tmp_path: Path, tokenizer, tiny_model_dir: Path) -> None:
    missing = RolloutConfig(vllm_python=str(tmp_path / "nope" / "python"))
    with pytest.raises(RelaxUserError, match="no Python at .*install_vllm_cpu.sh"):
        build_engine("vllm", str(tiny_model_dir), tokenizer, ModelConfig(), 0, rollout_cfg=missing)
    if importlib.util.find_spec("vllm") is None:  # the project's own venv never has it on CPU
        with pytest.raises(RelaxUserError, match="has no vllm"):
            vllm_python(sys.executable)


@pytest.mark.gpu_twin
def test_vllm_python_never_takes_the_cpu_venv_on_a_gpu(tmp_path: Path, monkeypatch) -> None:
    """The install script's venv (here a stand-in whose vllm probe succeeds) serves CPU machines only; on a
    GPU the configured Python or this one with vLLM, else one error saying so."""
    venv = tmp_path / "vllm-cpu"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text("#!/bin/sh\nexit 0\n")
    python.chmod(0o755)
    monkeypatch.setenv("RELAX_VLLM_VENV", str(venv))
    monkeypatch.delenv("RELAX_VLLM_PYTHON", raising=False)
    assert vllm_python(gpu=False) == str(python)
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(RelaxUserError, match="has a GPU and .* has no vllm .*not used on a GPU"):
            vllm_python(gpu=True)
    monkeypatch.setenv("RELAX_VLLM_PYTHON", str(python))  # an explicit choice is honoured everywhere
    assert vllm_python(gpu=True) == str(python)


@pytest.mark.gpu_twin
def test_gpu_settings_derive_from_the_run(tiny_model_dir: Path) -> None:
    """bf16 on a GPU (fp32 kept on vllm-cpu), 0.85 of the engine's GPU share, and a context sized for the
    run's prompts and responses (never past the model's own)."""
    assert (vllm_dtype("auto", gpu=True), vllm_dtype("auto", gpu=False)) == ("bfloat16", "float32")
    assert vllm_dtype("bfloat16", gpu=False) == "bfloat16"
    assert default_memory_fraction(1.0) == default_memory_fraction(0.0) == 0.85
    assert default_memory_fraction(0.5) == 0.425  # an engine colocated with a trainer on one GPU
    r = RolloutConfig(engine="vllm", max_prompt_len=100, max_new_tokens=28)
    assert max_model_len(r, str(tiny_model_dir)) == 128
    long_prompts = dataclasses.replace(r, max_prompt_len=1024)
    assert max_model_len(long_prompts, str(tiny_model_dir)) == 256  # the model's own context
    multi_turn = dataclasses.replace(r, env={"_target_": "x.Env"}, max_context_len=200)
    assert max_model_len(multi_turn, str(tiny_model_dir)) == 200
    assert max_model_len(dataclasses.replace(r, max_model_len=64), str(tiny_model_dir)) == 64
    assert max_model_len(RolloutConfig(), str(tiny_model_dir)) is None  # budget unknown: vLLM's default


def test_logprobs_mode_follows_truncation() -> None:
    assert logprobs_mode(0.7, 1.0, -1) == "processed_logprobs"
    assert logprobs_mode(1.0, 0.9, 20) == "raw_logprobs"


@needs_vllm
def test_greedy_equals_hf_before_and_after_weight_pushes(engine, tiny_model_dir: Path, tokenizer) -> None:
    """After each push (gloo broadcast, then disk), greedy outputs equal HF greedy decoding of the same weights."""
    reqs = requests(tokenizer)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    model = load_causal_lm(str(tiny_model_dir)).eval()
    eos = tokenizer.eos_token_id
    before = engine.generate(reqs, greedy)
    assert [r.output_ids for r in before] == [hf_greedy(model, r.input_ids, 12, eos) for r in reqs]
    assert {r.weight_version for r in before} == {0}
    # the engine's own push (rollout.server_weight_update=distributed) forms the group on the first update
    engine.update_weights(perturbed_state(model, seed=1), 1)
    pushes = {"distributed": engine.push, "disk": FolderPush.open(engine._post, engine.server_side)}
    for version, transfer in ((1, "distributed"), (2, "disk"), (3, "distributed")):
        engine.push = pushes[transfer]
        engine.update_weights(perturbed_state(model, seed=version), version)
        after = engine.generate(reqs, greedy)
        assert [r.output_ids for r in after] == [hf_greedy(model, r.input_ids, 12, eos) for r in reqs]
        assert {r.weight_version for r in after} == {version}
    assert [r.output_ids for r in after] != [r.output_ids for r in before]  # the pushes really landed
    # the disk fallback keeps one version folder at most
    assert len(list(pushes["disk"].root.iterdir())) <= 1
    pushes["disk"].close()


@needs_vllm
def test_logprobs_match_trainer_recomputation(engine, tokenizer, tiny_model_dir: Path) -> None:
    """n samples per prompt; each sampled token's log-prob is log softmax(z/T) as training recomputes it."""
    model = load_causal_lm(str(tiny_model_dir)).eval()
    engine.update_weights(model.state_dict(), 10)
    reqs = requests(tokenizer)
    results = engine.generate(reqs, SamplingParams(max_new_tokens=12, temperature=0.7, n=3))
    assert len(results) == len(reqs) * 3
    assert all(len(r.logprobs) == len(r.output_ids) > 0 for r in results)
    samples = [
        Sample(i // 3, i % 3, reqs[i // 3].input_ids, r.output_ids, r.logprobs, [1] * len(r.output_ids))
        for i, r in enumerate(results)
    ]
    batch = TrainBatch.from_samples(samples, tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    expected, _ = token_logprobs_and_entropy(logits, batch, temperature=0.7)
    torch.testing.assert_close(batch.rollout_logprobs, expected, atol=1e-4, rtol=0)
    assert len({tuple(r.output_ids) for r in results[:3]}) > 1  # the n samples are independent draws


@needs_vllm
def test_top_k_stop_token_and_stop_string(engine, tokenizer) -> None:
    reqs = requests(tokenizer)
    greedy = engine.generate(reqs, SamplingParams(max_new_tokens=12, temperature=0.0))
    # top-k = 1 at temperature 1 can only draw the argmax
    top1 = engine.generate(reqs, SamplingParams(max_new_tokens=12, temperature=1.0, top_k=1, n=2))
    assert [r.output_ids for r in top1] == [r.output_ids for r in greedy for _ in range(2)]
    long = max(greedy, key=lambda r: len(r.output_ids))
    request = reqs[greedy.index(long)]
    stop_id = long.output_ids[3]
    (cut,) = engine.generate([request], SamplingParams(12, temperature=0.0, stop_token_ids=[stop_id]))
    assert cut.finish_reason == "stop" and cut.output_ids[-1] == stop_id
    assert cut.output_ids == long.output_ids[: long.output_ids.index(stop_id) + 1]
    text = tokenizer.decode(long.output_ids[2:4])
    (by_text,) = engine.generate([request], SamplingParams(12, temperature=0.0, stop_strings=[text]))
    assert by_text.finish_reason == "stop" and len(by_text.output_ids) <= 4


@needs_vllm
def test_release_memory_on_vllm_cpu_leaves_the_server_serving(engine, tokenizer) -> None:
    """vllm-cpu has no sleep mode: a server started without it refuses the sleep endpoints naming the flag,
    and the engine's release/resume (rollout.release_memory_during_train) do nothing and it keeps serving."""
    refused = engine.http.post("/release_memory_occupation", json={})
    assert refused.status_code == 400 and "--enable-sleep-mode" in refused.text
    assert not engine.sleep_mode
    engine.release_memory()
    engine.resume_memory()
    [result] = engine.generate(requests(tokenizer)[:1], SamplingParams(max_new_tokens=4, temperature=0.0))
    assert len(result.output_ids) >= 1


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from relax_models.tiny_multimodal import build_tiny_qwen3_moe

    # head_dim 32: vllm-cpu's attention kernels take no 16 (conf/model/tiny_qwen3_moe.yaml's)
    return build_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_qwen3_moe"), seed=5, head_dim=32)


MOE_TEST = "test_moe_weights_reach_both_tensor_parallel_ranks"


@pytest.fixture(scope="module")
@heavy("starts a vLLM server")
def moe_engine(moe_dir: Path) -> Iterator[Future]:
    """The MoE test's engine (tensor-parallel 2) being started in a thread: the test takes its result."""
    rollout = RolloutConfig(
        engine="vllm", dtype="auto", tensor_parallel_size=2, memory_fraction=None, kv_cache_mib=16,
        max_prompt_len=24, max_new_tokens=6, num_threads=1,
    )  # fmt: skip
    with ThreadPoolExecutor(1) as pool:
        started = pool.submit(VLLMEngine.from_config, EngineSetup(str(moe_dir), 0, rollout))
        try:
            yield started
        finally:
            if started.exception() is None and started.result().server.alive():  # the test did not get to it
                started.result().shutdown()


def perturbed_experts(model, seed: int) -> dict[str, torch.Tensor]:
    """The model's state dict after a large change to the routed experts only (fused, as transformers
    keeps them): an engine that dropped the expert tensors would still generate what it did before."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp.experts." in name:
                p.add_(torch.randn(p.shape, generator=generator))
    return model.state_dict()


@pytest.mark.gpu_twin
@needs_vllm
def test_moe_weights_reach_both_tensor_parallel_ranks(moe_dir: Path, moe_engine: Future) -> None:
    """A tiny Qwen3-MoE on two tensor-parallel ranks, built from the run's config as a deployment would be:
    expert weights pushed in memory, in buckets smaller than a layer (each loaded as it arrives), then from
    disk; greedy outputs equal HF greedy decoding of the pushed weights. The context is the prompt budget
    plus max_new_tokens, not the model's 4,096: a prompt that fills it leaves room for the rest only."""
    engine = moe_engine.result()  # built from RolloutConfig by moe_engine
    try:
        tok = load_tokenizer(str(moe_dir))
        model = load_causal_lm(str(moe_dir)).eval()
        reqs, eos = requests(tok), tok.eos_token_id
        greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
        before = engine.generate(reqs, greedy)
        assert [r.output_ids for r in before] == [hf_greedy(model, r.input_ids, 6, eos) for r in reqs]
        sent: list[str] = []  # the names on the wire: the checkpoint's, which every vLLM loader takes

        def post(path: str, body: dict) -> dict:
            sent.extend(body.get("names", []))
            return engine._post(path, body)

        engine.push = DistributedPush(post, server_world_size=2, bucket_mb=1 / 32)
        state = perturbed_experts(model, seed=1)
        assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
        assert len(engine.push.buckets(state)) > 10
        engine.update_weights(state, 1)
        with safe_open(str(moe_dir / "model.safetensors"), "pt") as checkpoint:
            assert set(sent) - {"lm_head.weight"} == set(checkpoint.keys())  # tied: not saved
        after = engine.generate(reqs, greedy)
        assert [r.output_ids for r in after] == [hf_greedy(model, r.input_ids, 6, eos) for r in reqs]
        assert [r.output_ids for r in after] != [r.output_ids for r in before]
        engine.push.close()
        engine.push = FolderPush.open(engine._post, engine.server_side)
        engine.update_weights(perturbed_experts(model, seed=2), 2)
        on_disk = engine.generate(reqs, greedy)
        assert [r.output_ids for r in on_disk] == [hf_greedy(model, r.input_ids, 6, eos) for r in reqs]
        assert {r.weight_version for r in on_disk} == {2}
        # max_model_len = 24 + 6 = 30: a 27-token prompt may grow by 3 tokens only
        (full,) = engine.generate(
            [GenerationRequest((reqs[0].input_ids * 27)[:27], "long")],
            SamplingParams(6, temperature=0.0, ignore_eos=True),
        )
        assert (len(full.output_ids), full.finish_reason) == (3, "length")
    finally:
        engine.shutdown()


def _in_flight(engine) -> int:
    return engine.http.get("/get_model_info").json()["num_running"]


@needs_vllm
def test_ignore_eos_runs_every_sample_to_its_budget(engine, tokenizer) -> None:
    sampling = SamplingParams(40, n=8)
    free = engine.generate(requests(tokenizer), sampling)
    fixed = engine.generate(requests(tokenizer), dataclasses.replace(sampling, ignore_eos=True))
    check_ignore_eos(free, fixed, tokenizer.eos_token_id, budget=40)


@needs_vllm
def test_pause_abort_by_rid_and_resume(engine, tokenizer) -> None:
    """While paused, queued requests wait; aborting one by rid answers it, resume finishes the other."""
    engine.pause()
    reqs = requests(tokenizer)[:2]
    out: list = []
    worker = threading.Thread(target=lambda: out.extend(engine.generate(reqs, SamplingParams(8, n=2))))
    worker.start()
    deadline = time.monotonic() + 60
    while _in_flight(engine) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    engine.abort(["r0"])
    engine.resume()
    worker.join(timeout=120)
    assert [r.request_id for r in out] == ["r0", "r0", "r1", "r1"]
    assert {r.finish_reason for r in out[:2]} == {"abort"}
    assert all(r.finish_reason in ("stop", "length") and r.output_ids for r in out[2:])


def _abort_all_while_generating(engine, reqs, sampling: SamplingParams, paused: bool) -> list:
    """Generate in a thread; once the server holds every request, pause, abort them all, resume."""
    out: list = []
    if paused:
        engine.pause()
    worker = threading.Thread(target=lambda: out.extend(engine.generate(reqs, sampling)))
    worker.start()
    deadline = time.monotonic() + 60
    while _in_flight(engine) < len(reqs) and worker.is_alive() and time.monotonic() < deadline:
        time.sleep(0.005)
    if not paused:
        engine.pause()  # keep in-flight rows where they are, so the abort finds them mid-decode
    engine.abort()
    engine.resume()
    worker.join(timeout=120)
    assert len(out) == len(reqs) * sampling.n
    assert all(len(r.logprobs) == len(r.output_ids) <= sampling.max_new_tokens for r in out)
    return out


@needs_vllm
def test_abort_all_reaches_every_request_the_server_holds(engine, tokenizer) -> None:
    """Requests that just arrived (vLLM may still be admitting them) are aborted too: none runs after resume."""
    sampling = SamplingParams(200, n=8, ignore_eos=True)
    out = _abort_all_while_generating(engine, requests(tokenizer), sampling, paused=True)
    assert {r.finish_reason for r in out} == {"abort"}


@needs_vllm
def test_abort_all_returns_partial_results(engine, tokenizer) -> None:
    """Abort during decoding: rows come back 'abort' with the tokens generated so far and their log-probs.

    Rows ignore EOS, so only the abort or the budget ends them. vLLM's engine core decodes on while the
    server answers HTTP, so on a starved machine every row can reach its budget before the abort lands:
    such an attempt proves nothing and is repeated.
    """
    sampling = SamplingParams(200, n=8, ignore_eos=True)
    for _ in range(5):
        out = _abort_all_while_generating(engine, requests(tokenizer), sampling, paused=False)
        assert {r.finish_reason for r in out} <= {"abort", "length"}
        partial = [r for r in out if r.finish_reason == "abort" and r.output_ids]
        if partial:
            break
    assert partial and all(len(r.output_ids) < 200 for r in partial)


@needs_vllm
def test_killed_server_is_unhealthy_and_shutdown_leaves_no_process(engine, tokenizer) -> None:
    """Runs last: SIGKILL the server process; health turns false; shutdown reaps its whole group."""
    assert engine.health()
    os.kill(engine.server.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while engine.health() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not engine.health()
    with pytest.raises(httpx.HTTPError):
        engine.generate(requests(tokenizer)[:1], SamplingParams(4))
    engine.shutdown()
    assert group_members(engine.server.pid) == []  # vLLM's engine-core children went with it


SERVER_LIKE = """
import os, subprocess, sys, time
from relax_core.engines.http_server import guard_process_group
guard_process_group(int(sys.argv[1]))
subprocess.Popen(["sleep", "300"])  # stands in for vLLM's engine core, a child in the server's group
time.sleep(300)
"""
OWNER = """
import os, subprocess, sys, time
server = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())], start_new_session=True)
print(server.pid, flush=True)
time.sleep(300)
"""


def test_server_group_dies_with_the_process_that_started_it() -> None:
    """A Rollout or judge engine actor SIGKILLed (or its direct child, the server): the watchdog that both engine
    servers start (``--parent-pid``) takes the whole group down."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER, SERVER_LIKE], stdout=subprocess.PIPE, text=True)
    server_pid = int(owner.stdout.readline())
    deadline = time.monotonic() + 30
    while len(group_members(server_pid)) < 3 and time.monotonic() < deadline:  # server, watchdog, child
        time.sleep(0.1)
    assert len(group_members(server_pid)) == 3
    owner.kill()
    owner.wait()
    while group_members(server_pid) and time.monotonic() < deadline + 30:
        time.sleep(0.1)
    assert group_members(server_pid) == []
