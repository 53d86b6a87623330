"""Weight transfer between real Ray actors, every strategy; engine swaps mid-generation."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from relax_core.config.schema import WeightTransferConfig
from relax_core.weight_transfer import WeightReceiver, WeightSource, WeightTransfer, layout_of, plan_buckets


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


class Source(WeightSource):
    """The Actor's side: a "backend" whose state dict is version ``v`` of make_state."""

    def __init__(self) -> None:
        self.backend = self
        self.version = 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        return make_state(self.version)

    def set_version(self, version: int) -> None:
        self.version = version


class Consumer(WeightReceiver):
    """A weight consumer that keeps what it loaded."""

    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}
        self.version = -1

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self.loaded = {k: v.clone() for k, v in state_dict.items()}
        self.version = version

    def get(self) -> tuple[int, dict[str, torch.Tensor]]:
        return self.version, self.loaded


class FakeGroup:
    """The two RoleGroup members WeightTransfer uses: ``actors`` and ``call``."""

    def __init__(self, actors) -> None:
        self.actors = actors

    def call(self, method: str, *args):
        return [getattr(a, method).remote(*args) for a in self.actors]


def assert_holds(consumer, version: int) -> None:
    import ray

    got_version, got = ray.get(consumer.get.remote())
    expected = make_state(version)
    assert got_version == version and got.keys() == expected.keys()
    for k in expected:
        assert got[k].dtype == expected[k].dtype and torch.equal(got[k], expected[k]), k


@pytest.mark.parametrize("strategy", ["object_store", "shared_memory", "collective", "disk"])
def test_every_strategy_delivers_exact_versions(ray_cluster, tmp_path, strategy) -> None:
    """Each strategy moves consecutive versions bit for bit to every consumer, reports the bytes it
    moved, brings a late consumer to the newest version, and (but for a broadcast group) takes a restarted
    consumer in place."""
    import ray

    source = ray.remote(Source).options(num_cpus=0.1).remote()
    consumers = [ray.remote(Consumer).options(num_cpus=0.1).remote() for _ in range(3)]
    cfg = WeightTransferConfig(name=strategy, bucket_mb=0.04)
    transfer = WeightTransfer(strategy, FakeGroup([source]), cfg, str(tmp_path), None)
    try:
        transfer.connect("policy", consumers[:2])
        for version in (1, 2):  # consecutive versions reuse the channel
            ray.get(source.set_version.remote(version))
            stats = transfer.publish(version)
            assert stats.version == version
            assert stats.bytes == sum(v.numel() * v.element_size() for v in make_state(version).values())
            for c in consumers[:2]:
                assert_holds(c, version)
        ray.get(transfer.deliver(consumers[2]))  # e.g. an engine added by scale-out
        assert_holds(consumers[2], 2)
        if strategy != "collective":
            transfer.replace("policy", 0, consumers[2])
            ray.get(source.set_version.remote(3))
            transfer.publish(3)
            assert_holds(consumers[2], 3)
            assert_holds(consumers[1], 3)
        if strategy == "disk":  # only the newest folders stay
            assert sorted(p.name for p in (tmp_path / "rollout_weights" / "policy").iterdir()) == ["v2", "v3"]
    finally:
        transfer.close()
        for actor in (source, *consumers):
            ray.kill(actor)
    if strategy == "shared_memory":
        assert not list(Path("/dev/shm").glob(f"{transfer.tag}-*"))  # no file left behind


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from relax_core.engines.torch_engine import TorchEngine
    from relax_models.loader import load_causal_lm, load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    model = load_causal_lm(str(tiny_model_dir), "float32", "sdpa")
    return TorchEngine(model, tok.pad_token_id, [tok.eos_token_id], seed=3), tok


def _swap_during_generation(engine, mode: str):
    from relax_core.engines.base import GenerationRequest, SamplingParams
    from relax_core.engines.resumable import ResumableEngine

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


def test_auto_hands_weights_over_in_process_to_a_consumer_sharing_the_source_process(
    ray_cluster, tmp_path
) -> None:
    """A consumer in the source's own process (colocate's fused Actor + engine) gets exact versions through
    the in-process hand-over, which ``auto`` picks by itself; a consumer elsewhere still gets them."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from relax_core.runtime.groups import RoleGroup, SharedProcesses
    from relax_core.weight_transfer import consumer_strategies

    pg = placement_group([{"CPU": 0.2}])
    ray.get(pg.ready(), timeout=120)
    shared = SharedProcesses(pg, "source-consumer", ["source", "consumer"])
    source = RoleGroup(Source, "source", 1, pg, [0], 0.1, 0, shared=shared)
    consumer = RoleGroup(Consumer, "consumer", 1, pg, [0], 0.1, 0, shared=shared)
    try:
        routes, _ = consumer_strategies("auto", "colocate", source, consumer.actors, layout_of(make_state(0)))
        assert routes == ["in_process"]
        transfer = WeightTransfer("auto", source, WeightTransferConfig(), str(tmp_path), None)
        transfer.connect("policy", consumer.actors)
        for version in (1, 2):
            ray.get(source.actors[0].set_version.remote(version))
            transfer.publish(version)
            assert_holds(consumer.actors[0], version)
        # an engine in a process of its own (elastic scale-out) gets the newest version another way
        outside = ray.remote(Consumer).options(num_cpus=0.1).remote()
        ray.get(transfer.deliver(outside))
        assert_holds(outside, 2)
        ray.kill(outside)
        transfer.close()
    finally:
        source.kill()
        remove_placement_group(pg)


def test_weight_files_of_a_killed_run_are_removed_by_the_next_run() -> None:
    import os
    import subprocess

    from relax_core.weight_transfer.shared_memory import SHM_ROOT, remove_orphans

    gone = subprocess.Popen(["true"])
    gone.wait()  # a driver pid that no longer runs
    orphan = SHM_ROOT / f"relax-{gone.pid}-deadbeef-policy-float32.bin"
    mine = SHM_ROOT / f"relax-{os.getpid()}-deadbeef-policy-float32.bin"
    for path in (orphan, mine):
        path.write_bytes(b"\0" * 8)
    try:
        remove_orphans()
        assert not orphan.exists() and mine.exists()
    finally:
        mine.unlink(missing_ok=True)
        orphan.unlink(missing_ok=True)
