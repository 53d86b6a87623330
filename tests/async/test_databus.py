"""DataBus implementations: the same contract for the in-memory, Ray-actor and TransferQueue buses."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from relax_core.databus import (
    DataBusTimeout,
    InMemoryDataBus,
    PartitionCancelled,
    partition_name,
    sample_key,
)
from relax_core.databus.records import SAMPLE_FIELDS, batch_from_rows, per_sample, sample_rows
from relax_core.samples import Sample, TrainBatch


def make_samples(n: int, group_size: int = 2) -> list[Sample]:
    return [
        Sample(
            group_id=10 + i // group_size,
            index_in_group=i % group_size,
            prompt_ids=[1, 2, 3 + i],
            response_ids=list(range(4, 4 + 1 + i % 3)),
            rollout_logprobs=[-0.5 - 0.1 * j for j in range(1 + i % 3)],
            loss_mask=[1] * (1 + i % 3),
            reward=float(i) / n,
            policy_version=i % 2,
        )
        for i in range(n)
    ]


def check_contract(bus) -> None:
    part = partition_name(3)
    samples = make_samples(6)
    keys, fields = sample_rows(samples[:4], 0)
    bus.put(part, keys, fields)
    assert bus.ready(part, SAMPLE_FIELDS) == keys
    assert bus.ready(part, SAMPLE_FIELDS + ["advantages"]) == []
    # a second role adds a column to part of the rows: only those become ready for the next consumer
    bus.put(part, keys[:2], {"advantages": [torch.full((len(s.response_ids),), 0.5) for s in samples[:2]]})
    assert bus.ready(part, ["response_ids", "advantages"], task="actor") == keys[:2]
    rows = bus.get(part, keys[1::-1], SAMPLE_FIELDS + ["advantages"])  # order follows the keys asked for
    assert rows["response_ids"][0].tolist() == samples[1].response_ids
    assert rows["prompt_ids"][1].tolist() == samples[0].prompt_ids
    assert torch.allclose(rows["advantages"][0], torch.full((2,), 0.5))
    assert float(rows["reward"][0]) == pytest.approx(samples[1].reward)
    # consumption is per task
    bus.consume(part, keys[:1], "actor")
    assert bus.ready(part, ["advantages"], task="actor") == keys[1:2]
    assert bus.ready(part, ["advantages"], task="reference") == keys[:2]
    assert bus.consumed(part, "actor") == keys[:1]
    # later rows of the same step arrive while earlier ones are being consumed
    more_keys, more = sample_rows(samples[4:], 4)
    bus.put(part, more_keys, more)
    assert bus.ready(part, SAMPLE_FIELDS) == keys + more_keys
    assert part in bus.partitions()
    bus.clear(part)
    assert bus.ready(part, SAMPLE_FIELDS) == []
    assert part not in bus.partitions()
    # a cancelled partition stops its readers (a step being regenerated) until it is cleared
    bus.put(part, keys, fields)
    bus.cancel(part)
    with pytest.raises(PartitionCancelled):
        bus.ready(part, SAMPLE_FIELDS, task="actor")
    with pytest.raises(PartitionCancelled):
        bus.wait_ready(part, SAMPLE_FIELDS, "actor", min_count=99)
    assert bus.ready(partition_name(4), SAMPLE_FIELDS) == []  # other partitions are untouched
    bus.clear(part)
    bus.put(part, keys[:1], {name: values[:1] for name, values in fields.items()})
    assert bus.ready(part, SAMPLE_FIELDS) == keys[:1]
    bus.clear(part)
    check_waiting(bus, part, keys, fields)


def check_waiting(bus, part: str, keys: list[str], fields) -> None:
    """A consumer blocked in ``wait_ready`` gets the rows another thread writes meanwhile (only those of
    ``among`` count when it names some), and a cancel ends its wait."""

    def write_later(rows: slice) -> threading.Thread:
        def write() -> None:
            time.sleep(0.2)  # the consumer is waiting by then (if not, its first look finds the rows)
            bus.put(part, keys[rows], {name: values[rows] for name, values in fields.items()})

        thread = threading.Thread(target=write)
        thread.start()
        return thread

    writer = write_later(slice(0, 3))
    assert bus.wait_ready(part, SAMPLE_FIELDS, "actor", min_count=2, among={keys[0], keys[2]}) == [
        keys[0],
        keys[2],
    ]
    writer.join()
    writer = write_later(slice(3, 4))
    assert bus.wait_ready(part, SAMPLE_FIELDS, "actor", min_count=4) == keys
    writer.join()

    def cancel_later() -> None:
        time.sleep(0.2)
        bus.cancel(part)

    canceller = threading.Thread(target=cancel_later)
    canceller.start()
    with pytest.raises(PartitionCancelled):
        bus.wait_ready(part, SAMPLE_FIELDS, "actor", min_count=99)
    canceller.join()
    bus.clear(part)


def test_memory_bus_contract() -> None:
    check_contract(InMemoryDataBus())


def test_wait_ready_times_out_naming_the_partition() -> None:
    bus = InMemoryDataBus()
    with pytest.raises(DataBusTimeout, match="train_1: 0/2 rows"):
        bus.wait_ready("train_1", ["reward"], None, min_count=2, timeout_s=0.05)


def test_rows_rebuild_the_train_batch() -> None:
    samples = make_samples(5)
    keys, fields = sample_rows(samples, 0)
    assert keys == [sample_key(i) for i in range(5)] and keys == sorted(keys)
    expected = TrainBatch.from_samples(samples, pad_token_id=0)
    adv = torch.randn(expected.loss_mask.shape) * expected.loss_mask
    fields["advantages"] = per_sample(adv, expected)
    batch = batch_from_rows(fields, pad_token_id=0, extras=["advantages"])
    for name in ("input_ids", "attention_mask", "loss_mask", "rollout_logprobs", "rewards", "group_ids"):
        assert torch.equal(getattr(batch, name), getattr(expected, name)), name
    assert torch.equal(batch.policy_versions, expected.policy_versions)
    assert torch.allclose(batch.extras["advantages"], adv)


class Writer:
    """A role-like process that writes a column to the bus from another Ray worker."""

    def __init__(self, bus) -> None:
        self.bus = bus

    def add_advantages(self, part: str) -> list[str]:
        keys = self.bus.ready(part, ["response_ids"], task="advantages")
        rows = self.bus.get(part, keys, ["response_ids"])
        self.bus.put(part, keys, {"advantages": [torch.ones(len(r)) for r in rows["response_ids"]]})
        self.bus.consume(part, keys, "advantages")
        return keys


@pytest.mark.parametrize("name", ["ray", "transferqueue"])
def test_distributed_bus_contract_across_processes(ray_cluster, name: str) -> None:
    import ray

    from relax_core.databus import start_databus

    bus = start_databus(name)
    try:
        check_contract(bus)
        part = partition_name(7)
        keys, fields = sample_rows(make_samples(4), 0)
        bus.put(part, keys, fields)
        writer = ray.remote(Writer).options(num_cpus=0.1).remote(bus)
        assert ray.get(writer.add_advantages.remote(part)) == keys
        assert bus.ready(part, SAMPLE_FIELDS + ["advantages"], task="actor") == keys
        assert bus.ready(part, ["response_ids"], task="advantages") == []
        rows = bus.get(part, keys, ["advantages", "response_ids"])
        assert [len(a) for a in rows["advantages"]] == [len(r) for r in rows["response_ids"]]
        ray.kill(writer)
    finally:
        bus.close()


def test_transferqueue_refuses_without_free_cpus_with_a_clear_message(ray_cluster) -> None:
    """Its controller + storage unit reserve 2 logical CPUs; when they are taken it names the fix."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from relax_core.databus.transferqueue import TransferQueueDataBus
    from relax_core.errors import RelaxUserError

    def free_cpus_become(condition) -> None:
        # Ray's resource view lags: a killed actor's CPUs and a ready placement group show up later
        deadline = time.monotonic() + 60
        while not condition(ray.available_resources().get("CPU", 0.0)):
            assert time.monotonic() < deadline, ray.available_resources()
            time.sleep(0.2)

    total = ray.cluster_resources()["CPU"]
    free_cpus_become(lambda free: free == total)  # the previous test's bus and writer are gone
    pg = placement_group([{"CPU": total - 1.0}])
    ray.get(pg.ready(), timeout=60)
    free_cpus_become(lambda free: free <= 1.0)
    try:
        with pytest.raises(RelaxUserError, match="cluster.num_cpus"):
            TransferQueueDataBus.start()
    finally:
        remove_placement_group(pg)
