"""WeightSync: bucketed broadcast over a real gloo group between Ray actors; engine swaps mid-generation."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from relax_core.weight_sync import SyncSpec, WeightSyncGroup, free_port, layout_of, plan_buckets


def make_state(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {
        "embed.weight": torch.randn(300, 64, generator=g),  # 75 KiB: a bucket of its own
        "layer.0.weight": torch.randn(64, 64, generator=g),
        "layer.0.bias": torch.randn(64, generator=g),
        "steps": torch.tensor([version, 2 * version], dtype=torch.long),  # dtype change: new bucket
        "layer.1.weight": torch.randn(64, 64, generator=g),
    }


def test_plan_buckets_respects_size_and_dtype() -> None:
    layout = layout_of(make_state(0))
    buckets = plan_buckets(layout, bucket_mb=0.04)  # 40 KiB
    assert [[layout[i][0] for i in b] for b in buckets] == [
        ["embed.weight"],
        ["layer.0.weight", "layer.0.bias"],
        ["steps"],
        ["layer.1.weight"],
    ]
    assert plan_buckets(layout, bucket_mb=64) == [[0, 1, 2], [3], [4]]


class Member:
    """A Ray actor holding one rank of the group (rank 0 sends, the others receive)."""

    def address(self) -> tuple[str, int]:
        return free_port()

    def join(self, spec: SyncSpec, rank: int) -> int:
        self.group = WeightSyncGroup(spec, rank)
        return len(self.group.buckets)

    def send(self, version: int) -> int:
        return self.group.send(make_state(version))

    def receive(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.group.receive().items()}


def test_bucketed_broadcast_between_ray_actors(ray_cluster) -> None:
    import ray

    cls = ray.remote(Member).options(num_cpus=0.1)
    sender, *receivers = [cls.remote() for _ in range(3)]
    try:
        host, port = ray.get(sender.address.remote())
        spec = SyncSpec("policy", host, port, 3, layout_of(make_state(0)), bucket_mb=0.04)
        n_buckets = ray.get([m.join.remote(spec, r) for r, m in enumerate([sender, *receivers])], timeout=120)
        assert n_buckets == [4, 4, 4]
        for version in (1, 2):  # consecutive versions reuse the group
            refs = [r.receive.remote() for r in receivers]
            sent = ray.get(sender.send.remote(version), timeout=60)
            expected = make_state(version)
            assert sent == sum(v.numel() * v.element_size() for v in expected.values())
            for got in ray.get(refs, timeout=60):
                assert got.keys() == expected.keys()
                for k in expected:
                    assert got[k].dtype == expected[k].dtype and torch.equal(got[k], expected[k]), k
    finally:
        for m in (sender, *receivers):
            ray.kill(m)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from relax_core.engines.torch_engine import TorchEngine
    from relax_models.loader import load_causal_lm, load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    model = load_causal_lm(str(tiny_model_dir), "float32", "sdpa")
    return TorchEngine(model, tok.pad_token_id, [tok.eos_token_id], seed=3), tok


def _swap_during_generation(engine, mode: str):
    from relax_core.async_loop import ResumableEngine
    from relax_core.engines.base import GenerationRequest, SamplingParams

    base, tok = engine
    base.weight_version = 0
    wrapped = ResumableEngine(base, mode)
    new_state = {k: v.clone() for k, v in base.model.state_dict().items()}
    requests = [GenerationRequest(tok(f"sort {i}{i + 3}1:").input_ids, str(i)) for i in range(8)]
    # no stop token: every row runs to max_new_tokens unless aborted
    sampling = SamplingParams(max_new_tokens=96, temperature=1.0, n=2, stop_token_ids=[])
    base.eos_token_ids = [-1]
    out: list = []
    worker = threading.Thread(target=lambda: out.extend(wrapped.generate(requests, sampling)))
    worker.start()
    deadline = time.monotonic() + 30
    while not wrapped._lock.locked() and time.monotonic() < deadline:  # generation has started
        time.sleep(0.001)
    time.sleep(0.02)
    wrapped.swap(new_state, 1)
    worker.join(timeout=120)
    base.eos_token_ids = [tok.eos_token_id]
    return wrapped, out


def test_partial_rollout_abort_resumes_on_new_weights(engine) -> None:
    wrapped, results = _swap_during_generation(engine, "abort")
    assert len(results) == 16
    assert wrapped.swaps == 1 and wrapped.resumed == 16  # every row was cut short and resumed
    assert all(r.finish_reason == "length" and len(r.output_ids) == 96 for r in results)
    assert all(len(r.logprobs) == 96 for r in results)
    assert {r.weight_version for r in results} == {0}  # tagged with the version of their first tokens
    assert engine[0].weight_version == 1


def test_partial_rollout_finish_keeps_old_weights_until_done(engine) -> None:
    wrapped, results = _swap_during_generation(engine, "finish")
    assert wrapped.resumed == 0 and wrapped.swaps == 1
    assert all(r.finish_reason == "length" and len(r.output_ids) == 96 for r in results)
    assert {r.weight_version for r in results} == {0}
    assert engine[0].weight_version == 1  # the swap landed after the in-flight call finished
