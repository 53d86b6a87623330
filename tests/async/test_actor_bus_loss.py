"""The data bus dies while the Actor streams a step (mode=async): before the step's first optimizer update the
Actor raises the bus's error, so the scheduler recovers and regenerates the step; after an update it reports
the step half-trained, so the scheduler restarts from a checkpoint instead of training those rows twice."""

from __future__ import annotations

import threading
import time

import ray
import torch

from relax_core.algorithms.spec import requirements
from relax_core.databus import partition_name
from relax_core.databus.ray_bus import RayDataBus
from relax_core.databus.records import SAMPLE_FIELDS, sample_rows
from relax_core.databus.stages import BusStep
from relax_core.roles.actor import Actor
from relax_core.samples import Sample
from tests.core.conftest import compose_config

ROWS, GLOBAL_BATCH = 8, 4  # two optimizer updates per step


def rows(first: int, n: int) -> tuple[list[str], dict[str, list[torch.Tensor]]]:
    samples = [
        Sample(
            group_id=i // 4,
            index_in_group=i % 4,
            prompt_ids=[5, 6, 7 + i % 3],
            response_ids=[8 + i % 5, 9, 10],
            rollout_logprobs=[-1.0, -1.2, -0.8],
            loss_mask=[1, 1, 1],
            reward=float(i % 2),
            policy_version=0,
        )
        for i in range(first, first + n)
    ]
    keys, fields = sample_rows(samples, first)
    fields["advantages"] = [torch.full((3,), 1.0 if s.reward else -1.0) for s in samples]
    fields["old_logprobs"] = [torch.tensor(s.rollout_logprobs) for s in samples]
    return keys, fields


def train_while_the_bus_dies(tmp_path, tiny_model_dir, rows_before_kill: int):
    cfg = compose_config(
        [
            "mode=async",
            "rollout.batch_size=2",
            "rollout.n_samples_per_prompt=4",
            f"trainer.global_batch_size={GLOBAL_BATCH}",
            "trainer.micro_batch_size=2",
            "trainer.num_threads=1",
        ],
        tmp_path,
    )
    bus = RayDataBus.start()
    actor = Actor(cfg, str(tiny_model_dir), bus=bus)
    before = [p.detach().clone() for p in actor.backend.model.parameters()]
    need = requirements(cfg).train_fields
    assert set(need) == {"advantages", "old_logprobs"}
    outcome: dict[str, object] = {}

    def train() -> None:
        try:
            outcome["metrics"] = actor.train(1, BusStep(ROWS, SAMPLE_FIELDS + list(need), list(need)))
        except Exception as err:  # noqa: BLE001  (the test inspects it)
            outcome["error"] = err

    thread = threading.Thread(target=train)
    thread.start()
    bus.put(partition_name(1), *rows(0, rows_before_kill))
    if rows_before_kill >= GLOBAL_BATCH:  # wait for the first optimizer update: the weights move
        while all(torch.equal(a, b) for a, b in zip(before, actor.backend.model.parameters(), strict=True)):
            assert thread.is_alive(), outcome
            time.sleep(0.05)
    ray.kill(bus.server, no_restart=True)
    thread.join(timeout=300)
    assert not thread.is_alive()
    return outcome


def test_bus_dying_before_the_first_update_raises_its_error(ray_cluster, tmp_path, tiny_model_dir) -> None:
    outcome = train_while_the_bus_dies(tmp_path, tiny_model_dir, rows_before_kill=2)
    assert isinstance(outcome.get("error"), ray.exceptions.RayActorError), outcome


def test_bus_dying_after_an_update_reports_a_half_trained_step(ray_cluster, tmp_path, tiny_model_dir) -> None:
    outcome = train_while_the_bus_dies(tmp_path, tiny_model_dir, rows_before_kill=GLOBAL_BATCH)
    assert outcome.get("metrics") == {"cancelled": 1.0, "optimizer_steps": 1.0}, outcome
