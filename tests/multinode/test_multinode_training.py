"""Training ranks on several nodes: FSDP and megatron groups meet wherever Ray puts their ranks, sharded
checkpoints written by ranks on two nodes resume exactly, and a run dir one node cannot see is refused at
launch. Three nodes in network namespaces (``netns_cluster.py``): each has its own 127.0.0.1, so a group
that met on the driver's loopback would never form."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns_cluster import NetnsCluster, skip_reason

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "resilience"))
from resilience_helpers import TINY_RUN  # noqa: E402

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

# the resilience tests' tiny run (2 warm-start steps, 4 prompts x 4 samples per RL step), 4 RL steps
RUN = [o for o in TINY_RUN if not o.startswith("cluster.")] + ["seed=5", "trainer.total_steps=4"]
# the head has 2 Ray CPUs, each worker 1: bundle 0 (engine + rank 0, 2 CPUs) fits only the head, bundle 1
# (rank 1) no longer fits there, so Ray must put the two ranks on two nodes
SPREAD = ["rollout.num_cpus=1", "trainer.num_cpus=1"]
RANK_FILES = ["fsdp_rank00000.pt", "fsdp_rank00001.pt"]  # what each sharded role saves
# where the driver found Actor rank i (cli.log): rank 0 on the head, rank 1 on a worker
TWO_NODES = re.compile(r"actor ranks on nodes: 10\.81\.0\.1, 10\.81\.0\.[23]$", re.M)


@pytest.fixture(scope="module")
def cluster() -> Iterator[NetnsCluster]:
    reason = skip_reason()
    if reason:
        pytest.skip(f"no multi-node cluster: {reason}")
    with NetnsCluster(cpus=[2, 1, 1], net=81) as nodes:
        yield nodes


def _launch(cluster: NetnsCluster, run_dir: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    """``python -m relax_launch`` on the head node, attached to the cluster's Ray."""
    argv = [sys.executable, "-m", "relax_launch", "cluster=ray", f"cluster.address={cluster.address}"]
    return cluster.run(0, [*argv, *overrides, f"hydra.run.dir={run_dir}"], timeout=900)


def _finished(done: subprocess.CompletedProcess, run_dir: Path) -> dict[int, dict]:
    """The per-step rows of a run that must have finished."""
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "reward/mean" in r}


def test_a_run_dir_one_node_cannot_see_is_refused_at_launch_in_one_line(cluster: NetnsCluster) -> None:
    """``cluster.local_dir`` is a different tmpfs on every node: the marker the driver writes on the head
    is missing on the workers, so the run stops before any role starts, naming the path and the setting."""
    run = cluster.local_dir / "run"
    done = _launch(cluster, run, [*RUN, "trainer=fsdp", *SPREAD, "trainer.total_steps=1"])
    assert done.returncode == 2, done.stderr[-4000:]
    last = [ln for ln in done.stderr.splitlines() if ln.strip()][-1]
    assert re.fullmatch(
        rf"error: hydra\.run\.dir={run} is not visible from Ray node\(s\) 10\.81\.0\.2, 10\.81\.0\.3 of this "
        r"3-node cluster .*: set hydra\.run\.dir to a folder on a filesystem every node mounts .*",
        last,
    ), last
    assert "Traceback" not in done.stderr
    assert "roles up" not in done.stdout + done.stderr
    left = cluster.run(0, ["ls", "-A", str(run)]).stdout.split()  # the run dir lives on the head alone
    assert "cli.log" in left and not [f for f in left if f.startswith(".relax-shared-")]  # marker gone


def test_fsdp_ranks_on_two_nodes_take_the_single_rank_steps_and_resume_from_their_shards(
    cluster: NetnsCluster, tmp_path: Path
) -> None:
    """2 FSDP ranks on two nodes take the one-rank run's steps (same rollouts: rewards to the last digit;
    losses up to the order of the gradient all-reduce), write one shard per rank into the shared run dir,
    and a second launch resumed from step 2 (offloading between phases, which changes nothing on the CPU)
    takes the uninterrupted run's steps 3 and 4 bit for bit."""
    single = tmp_path / "single"  # the reference: one rank, every role in one process on this machine
    command = [sys.executable, "-m", "relax_launch", *RUN, "cluster=in_process", f"hydra.run.dir={single}"]
    one = _finished(subprocess.run(command, capture_output=True, text=True, timeout=900), single)

    spread, sharded = tmp_path / "spread", [*RUN, "trainer=fsdp", "trainer.dp_size=2", *SPREAD]
    two = _finished(_launch(cluster, spread, [*sharded, "trainer.save_every=2"]), spread)
    assert TWO_NODES.search((spread / "cli.log").read_text())
    assert sorted(two) == sorted(one) == [1, 2, 3, 4]
    for step in (1, 2, 3):  # float differences of the all-reduce may flip one sampled token later on
        assert two[step]["reward/mean"] == one[step]["reward/mean"], step
        assert two[step]["loss"] == pytest.approx(one[step]["loss"], rel=1e-3, abs=1e-5), step

    ckpt = spread / "checkpoints" / "step_000002"
    actor = ckpt / "actor"
    assert sorted(p.name for p in actor.glob("fsdp_rank*.pt")) == RANK_FILES  # rank 1 wrote from its node
    assert len(list((actor / "dcp").glob("*.distcp"))) == 2  # one shard file per rank
    assert not (actor / "backend.pt").exists()  # no full copy of the model in the checkpoint

    resumed = tmp_path / "resumed"
    again = [*sharded, f"trainer.resume={ckpt}", "trainer.offload=true"]
    rows = _finished(_launch(cluster, resumed, again), resumed)
    assert TWO_NODES.search((resumed / "cli.log").read_text())
    assert [rows[s]["reward/mean"] for s in (3, 4)] == [two[s]["reward/mean"] for s in (3, 4)]
    assert all("time/offload_s" in rows[s] and "time/onload_s" in rows[s] for s in (3, 4))
    assert not any("time/offload_s" in r for r in two.values())
    from transformers import AutoModelForCausalLM  # rank 0 exported the gathered weights

    AutoModelForCausalLM.from_pretrained(resumed / "final_model")


def test_megatron_tensor_parallel_ranks_on_two_nodes_take_the_one_node_steps(
    cluster: NetnsCluster, tmp_path: Path
) -> None:
    """TP=2 with the two halves of every layer on two nodes, all-reducing through rank 0's node IP, against
    TP=1 on the head alone. Both start from the same warm-start and differ only by the all-reduce's summation
    order, so they sample the same tokens: equal rewards, and loss / gradient norm / entropy equal to float
    noise. The warm-started weights reach the engine only through rank 0's ``state_dict``: the greedy eval
    after the warm-start differs from the one before it."""
    small = [o for o in RUN if not o.startswith(("trainer.sft_warmup_steps", "trainer.total_steps"))]
    small += ["trainer=megatron", "trainer.sft_warmup_steps=10", "trainer.total_steps=2", *SPREAD]
    one = _finished(_launch(cluster, tmp_path / "tp1", small), tmp_path / "tp1")
    run = tmp_path / "tp2"
    two = _finished(_launch(cluster, run, [*small, "trainer.megatron.tensor=2"]), run)
    assert TWO_NODES.search((run / "cli.log").read_text())
    assert sorted(two) == sorted(one) == [1, 2]
    start = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][0]
    assert start["step"] == 0 and start["eval/reward"] != start["eval/reward_init"]  # published weights used
    for step in (1, 2):
        assert two[step]["reward/mean"] == pytest.approx(one[step]["reward/mean"], abs=1e-6), step
        for key in ("loss", "pg_loss", "entropy", "grad_norm", "lr"):
            assert two[step][key] == pytest.approx(one[step][key], rel=1e-3, abs=1e-6), (step, key)
