"""GPU placement, checked on the CPU: Ray started with fake GPUs hands them out as on a GPU node (placement
groups, ``CUDA_VISIBLE_DEVICES`` per role, fractional colocation of the Actor and its engine, zero-GPU roles),
and the weight-transfer backend is chosen from what each member was given. Configs whose GPUs cannot hold
what they ask stop in validation with one line naming the setting."""

from __future__ import annotations

import os
import sys

import pytest
import ray
from ray import cloudpickle
from ray.util.placement_group import remove_placement_group
from tiers import heavy

from relax_core.config.schema import WeightTransferConfig
from relax_core.errors import RelaxUserError
from relax_core.preflight.validation import validate
from relax_core.runtime.groups import RoleGroup, SharedProcesses
from relax_core.runtime.placement import reserve
from relax_core.weight_transfer import WeightTransfer
from relax_core.weight_transfer.base import TRANSPORTS, WeightReceiver, WeightSource

pytestmark = pytest.mark.gpu_twin

# the workers cannot import this test module by name: ship its classes by value
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Probe(WeightSource, WeightReceiver):
    """A role-like class that says which GPUs its process was shown."""

    def __init__(self, replica: int = -1) -> None:
        self.replica = replica

    def visible(self) -> str | None:
        return os.environ.get("CUDA_VISIBLE_DEVICES")

    def weights_layout(self) -> list[tuple[str, tuple[int, ...], str]]:
        return [("w", (2,), "float32")]


# ---------------------------------------------------------------- in-process: the pure rules


def test_collective_backend_needs_a_gpu_of_its_own_per_member() -> None:
    from relax_core.weight_transfer.collective import collective_backend

    assert collective_backend([("n1", ["0"]), ("n1", ["1"]), ("n2", ["0"])]) == "nccl"
    assert collective_backend([("n1", ["0"]), ("n1", ["0"])]) == "gloo"  # fractional colocation
    assert collective_backend([("n1", ["0"]), ("n1", [])]) == "gloo"  # a GPU-less member
    assert collective_backend([("n1", ["2", "3"]), ("n1", ["2"])]) == "gloo"  # both use GPU 2 as cuda:0


def test_role_device_and_process_group_device_agree() -> None:
    """Ray narrows CUDA_VISIBLE_DEVICES: a rank given two GPUs uses cuda:0, not cuda:RANK (the old FSDP
    ``set_device(rank % count)``); torchrun's LOCAL_RANK still picks."""
    from relax_models.devices import local_cuda_index

    assert local_cuda_index(2, {"RANK": "1", "WORLD_SIZE": "2"}) == 0
    assert local_cuda_index(8, {"RANK": "9", "LOCAL_RANK": "1"}) == 1


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["cluster.num_gpus=8"], "trainer.num_gpus=0 on a GPU run (cluster.num_gpus=8)"),
        (
            ["cluster.num_gpus=8", "trainer.num_gpus=1"],
            "rollout.num_gpus=0 on a GPU run (cluster.num_gpus=8)",
        ),
        (
            ["rollout=vllm", "rollout.tensor_parallel_size=2", "rollout.num_gpus=1", "trainer.num_gpus=1"]
            + ["cluster.num_gpus=8"],
            "rollout.tensor_parallel_size=2 needs 2 GPUs per engine but rollout.num_gpus=1 gives it 1: "
            "set rollout.num_gpus=2",
        ),
        (  # engine 0 + Actor: 3 GPUs, engines 1-3: 2 each = 9 > 8
            ["rollout.num_engines=4", "rollout.num_gpus=2", "trainer.num_gpus=1", "cluster.num_gpus=8"],
            "the roles ask for 9 GPUs (bundles of up to 3) but cluster.num_gpus=8 gives 1 node(s) 8 each: "
            "raise cluster.num_gpus",
        ),
        (  # 5 in total fits 2 x 4, but one bundle (engine + Actor rank) must sit on one node
            ["cluster=slurm", "cluster.nodes=2", "cluster.gpus_per_node=4"]
            + ["rollout.num_gpus=4", "trainer.num_gpus=1"],
            "raise cluster.gpus_per_node",
        ),
        (["rollout.num_gpus=1", "trainer.num_gpus=1"], "cluster.num_gpus=0 gives 1 node(s) 0 each"),
        (
            ["trainer.num_gpus=1.5", "rollout.num_gpus=1"],
            "trainer.num_gpus=1.5: Ray gives a share of one GPU",
        ),
    ],
)
def test_gpus_that_cannot_hold_the_run_stop_in_validation(make_cfg, overrides, needle) -> None:
    with pytest.raises(RelaxUserError) as err:
        validate(make_cfg(*overrides))
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "overrides",
    [
        [],  # the CPU default: zero GPUs everywhere is fine
        # Actor rank i and engine i share GPU i
        ["cluster.num_gpus=2", "rollout.num_engines=2", "rollout.num_gpus=0.5", "trainer.num_gpus=0.5"]
        + ["trainer.dp_size=2", "trainer.fsdp=true"],
    ],
)
def test_gpus_that_hold_the_run_pass(make_cfg, overrides) -> None:
    validate(make_cfg(*overrides))


# ---------------------------------------------------------------- Ray with 8 fake GPUs


@pytest.fixture(scope="module")
@heavy("starts a local Ray")
def fake_gpus():
    ray.init(address="local", num_cpus=4, num_gpus=8, include_dashboard=False, log_to_driver=False)
    pgs = []
    try:
        yield pgs
    finally:
        for pg in pgs:
            remove_placement_group(pg)
        ray.shutdown()


def _group(name: str, replicas: int, pg, gpus: float, **kw) -> RoleGroup:
    return RoleGroup(Probe, name, replicas, pg, list(range(replicas)), 0.05, gpus, pass_replica=True, **kw)


def test_roles_see_the_gpus_they_were_given_and_the_backend_follows(fake_gpus) -> None:
    # colocate's bundles for 2 engines and 2 Actor ranks at 0.5 GPU each: engine i + rank i share GPU i
    pg = reserve([{"CPU": 0.5, "GPU": 1.0}] * 2, "twin-colocate")
    tp_pg = reserve([{"CPU": 0.1, "GPU": 2.0}], "twin-tp2")  # a tensor-parallel-2 engine: whole GPUs
    fake_gpus += [pg, tp_pg]
    actor, rollout = _group("actor", 2, pg, 0.5), _group("rollout", 2, pg, 0.5)
    helper = _group("advantages", 1, pg, 0.0)
    engine = _group("engine", 1, tp_pg, 2.0)
    shared = SharedProcesses(pg, "fused", ["a", "b"])
    fused = [_group(name, 1, pg, 0.0, shared=shared) for name in ("a", "b")]
    seen = {
        name: ray.get(group.call("visible"))
        for name, group in [("actor", actor), ("rollout", rollout), ("helper", helper), ("engine", engine)]
        + [("fused", fused[0])]
    }
    assert seen["actor"] == seen["rollout"]  # fractional colocation: rank i and engine i on one GPU
    assert all(len(v.split(",")) == 1 for v in seen["actor"]) and len(set(seen["actor"])) == 2
    (tp,) = seen["engine"]
    assert len(set(tp.split(","))) == 2 and not set(tp.split(",")) & set(seen["actor"])
    # zero GPUs on a GPU cluster: shown none, not every GPU of the node
    assert seen["helper"] == [""] and seen["fused"] == [""]

    transfer = WeightTransfer("collective", actor, WeightTransferConfig(), ".", ".")

    def backend(consumers: list) -> str:
        return TRANSPORTS["collective"].spec(transfer, "policy", consumers).backend

    assert backend([rollout.actors[1], engine.actors[0]]) == "nccl"  # each on a GPU of its own
    assert backend(rollout.actors) == "gloo"  # rollout 0 shares the Actor's GPU
    assert backend(helper.actors) == "gloo"  # a member without a GPU
