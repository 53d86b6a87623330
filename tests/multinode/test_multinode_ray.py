"""A Ray cluster of three nodes in network namespaces (``netns_cluster.py``; head 10.81.0.1 with 2 Ray CPUs,
two workers with 1 each): each node has its own 127.0.0.1, so a group that met on the driver's loopback would
never form, and its own /dev/shm, so shared memory that crossed nodes would hand an engine zeros.

One cluster serves every test of this module, in the order written: the training runs first (they need the
three nodes as started), then the judge that loses its node, which comes back, then the async run that loses
a node and gets it back, then the colocate run that loses a node for good and takes a joining one.

- Training ranks: FSDP and megatron groups meet wherever Ray puts their ranks, sharded checkpoints written by
  ranks on two nodes resume exactly, and a run dir one node cannot see is refused at launch.
- A GenRM judge engine on a worker serves the driver's router on the head, and moves when its node dies.
- Rollout engines on other nodes than the Actor: each gets the weights through the channel that reaches it,
  an engine's node dying mid-run is survived, and a node joining mid-run takes the engine a scale-out adds.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from netns_cluster import NetnsCluster, _sh, skip_reason

from relax_models.ports import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "resilience"))
from resilience_helpers import TINY_RUN, read_metrics  # noqa: E402

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

NET = 81
TOKEN = "multinode-engines"
RUNNING = ("PENDING", "CREATING", "CONNECTING", "HEALTH_CHECKING", "WEIGHT_SYNCING", "DRAINING", "REMOVING")
# Ray's GCS declares a node dead after period x threshold without a health check (15 s by default)
FAST_NODE_DEATH = {"RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "3"}
# the resilience tests' tiny run (2 warm-start steps, 4 prompts x 4 samples per RL step), 4 RL steps
RUN = [o for o in TINY_RUN if not o.startswith("cluster.")] + ["seed=5", "trainer.total_steps=4"]
# a CPU per engine and per Actor rank: bundle 0 (engine 0 + rank 0, 2 CPUs) fits only the head, so a second
# rank or engine must go to a worker
SPREAD = ["rollout.num_cpus=1", "trainer.num_cpus=1"]
RANK_FILES = ["fsdp_rank00000.pt", "fsdp_rank00001.pt"]  # what each sharded role saves
# where the driver found Actor rank i (cli.log): rank 0 on the head, rank 1 on a worker
TWO_NODES = re.compile(r"actor ranks on nodes: 10\.81\.0\.1, 10\.81\.0\.[23]$", re.M)


@pytest.fixture(scope="module")
def cluster() -> Iterator[NetnsCluster]:
    reason = skip_reason()
    if reason:
        pytest.skip(f"no multi-node cluster: {reason}")
    with NetnsCluster(cpus=[2, 1, 1], net=NET, ray_env=FAST_NODE_DEATH) as nodes:
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


def _wait(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=2).is_success
    except httpx.HTTPError:
        return False


def _steps(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "reward/mean" in r]


# the judge's engine placed on a worker (the head's CPUs held), scored from the head, its node lost, scored again
JUDGE_ON_A_WORKER = """
import json, sys, time
import ray
from ray.util.placement_group import placement_group
from relax_core.config.schema import RelaxConfig
from relax_core.rollout.judge import start_judge
from relax_core.runtime.placement import bundle_nodes
from relax_rewards import RewardExecutor, RewardItem
from relax_rewards.config import JudgeConfig, RewardConfig

ray.init(address=sys.argv[1], logging_level="ERROR")
ray.get(placement_group([{"CPU": 2}]).ready())  # the head's CPUs: the judge's bundle goes to a worker
cfg = RelaxConfig(output_dir=sys.argv[2])
judge = JudgeConfig(model="tiny_qwen3", num_cpus=1, health_interval_s=0.5, wait_s=1.0, hang_timeout_s=5.0)
cfg.reward = RewardConfig(name="genrm", judge=judge)
group = start_judge(cfg)
items = [RewardItem(f"s{i}", str(i), "3", {"question": "1+2?"}, group_id=i) for i in range(4)]
kwargs = {"url": cfg.reward.kwargs["url"], "template": "{question} {response}", "verdict_pattern": "^",
          "correct_verdict": "", "sampling_params": {"max_new_tokens": 2}}
def scores():
    with RewardExecutor(RewardConfig(name="genrm", num_workers=0, kwargs=kwargs)) as ex:
        return [o.reward for o in ex.score(items)]
def report(**extra):
    print(json.dumps({"node": bundle_nodes(group.pg)[0], "scores": scores(), **extra}), flush=True)
report()
sys.stdin.readline()  # the test lost the judge's node
while not (group.restarts and group.router.keys(routable_only=True)):
    time.sleep(0.5)
report(restarts=group.restarts)
group.stop()
"""


def _report(job: subprocess.Popen) -> dict | None:
    """The next JSON line ``job`` prints (Ray writes lines of its own there too); None at its end."""
    for line in job.stdout:
        if line.startswith("{"):
            return json.loads(line)
        print(line, end="")
    return None


# a Source on the head and a consumer pinned to a worker, asked for forced shared memory
FORCED_SHM = """
import ray, sys
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from relax_core.errors import RelaxUserError
from relax_core.weight_transfer import WeightReceiver, WeightSource, consumer_strategies

ray.init(address=sys.argv[1], logging_level="ERROR")
node = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
def on(ip):
    return ray.remote(WeightReceiver).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node[ip], soft=False)
    ).remote()
class Group:
    actors = [on(sys.argv[2])]
try:
    consumer_strategies("shared_memory", "async", Group, [on(sys.argv[2]), on(sys.argv[3])], [])
except RelaxUserError as err:
    print(err)
"""


def test_a_judge_engine_on_a_worker_serves_the_head_and_moves_when_its_node_is_lost(
    cluster: NetnsCluster, tmp_path: Path
) -> None:
    """reward.judge in Ray's placement: with the head's CPUs held, the judge engine's bundle lands on a
    worker, where its server listens on that node's own 127.0.0.1; the router on the head reaches it through
    the engine's actor. The worker dies: the bundle moves to the other worker, a new actor serves there."""
    argv = [sys.executable, "-c", JUDGE_ON_A_WORKER, cluster.address, str(tmp_path)]
    job = cluster.popen(0, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    lost = None
    try:
        first = _report(job)
        assert first is not None, job.communicate(timeout=60)
        workers = {cluster.node_ip(1), cluster.node_ip(2)}
        assert first["node"] in workers and first["scores"] == [1.0] * 4, first
        lost = int(first["node"].rsplit(".", 1)[1]) - 1
        cluster.kill_node(lost)
        job.stdin.write("lost\n")
        job.stdin.flush()
        second = _report(job)
        assert second is not None and job.wait(timeout=120) == 0, job.communicate(timeout=60)
        assert second["node"] == (workers - {first["node"]}).pop(), second
        assert second["scores"] == [1.0] * 4 and second["restarts"] >= 1, second
    finally:
        if job.poll() is None:
            job.kill()
        if lost is not None:
            cluster.start_node(lost)  # the next tests need the three nodes


def test_async_run_loses_an_engine_or_actor_node_and_finishes_from_its_checkpoint(
    cluster: NetnsCluster, tmp_path: Path
) -> None:
    """An async run on three nodes: the followers off the Actor's node join a broadcast group, the one on
    it shared memory. A worker holding an engine or the Actor dies mid-run: the broadcast group (or the
    Actor's optimizer state) is gone with it, so the run restarts from its last checkpoint; the two nodes
    left cannot hold every role, so it waits until the node comes back, then finishes, every step logged
    once. Forcing shared memory across nodes is one clear error."""
    forced = cluster.run(
        0,
        [sys.executable, "-c", FORCED_SHM, cluster.address, cluster.node_ip(0), cluster.node_ip(1)],
        timeout=120,
    )
    assert forced.stdout.strip() == (
        f"weight_transfer=shared_memory: consumer 1 runs on node {cluster.node_ip(1)}, the Actor on "
        f"{cluster.node_ip(0)}, and /dev/shm does not cross nodes: set weight_transfer=auto (or object_store)"
    ), forced.stdout + forced.stderr[-2000:]

    run_dir, total = tmp_path / "run", 14
    overrides = [o for o in TINY_RUN if not o.startswith(("cluster.", "trainer.sft"))]
    argv = [
        sys.executable,
        "-m",
        "relax_launch",
        "cluster=ray",
        f"cluster.address={cluster.address}",
        "mode=async",
    ]
    argv += [*overrides, "trainer.sft_warmup_steps=0", "rollout.num_engines=2", *SPREAD]
    argv += ["trainer.save_every=2"]
    argv += [f"trainer.total_steps={total}", f"hydra.run.dir={run_dir}"]
    log_path = tmp_path / "job.log"
    with open(log_path, "w") as log_file:
        job = cluster.popen(0, argv, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        _wait(lambda: len(_steps(run_dir)) >= 2 or job.poll() is not None, 300, "the second step")
        assert job.poll() is None, log_path.read_text()[-3000:]
        found = re.findall(
            r"policy consumer \d on node (\S+) \(Actor on (\S+)\) <- (\w+)", log_path.read_text()
        )
        head, actor = cluster.node_ip(0), found[0][1]
        assert all(route == ("shared_memory" if ip == actor else "collective") for ip, _, route in found), (
            found
        )
        # the worker to lose: one holding an engine, else the one holding the Actor (the engines fill the head)
        victim = next((ip for ip, _, _ in found if ip != head), actor)
        assert victim != head, found
        lost = int(victim.rsplit(".", 1)[1]) - 1
        cluster.kill_node(lost)
        # the two nodes left cannot hold every role (3 CPUs of 3.35): the restart waits for the node to return
        _wait(
            lambda: "waiting for a node to join" in log_path.read_text(), 180, "the restart to wait for room"
        )
        cluster.start_node(lost)
        assert job.wait(timeout=600) == 0, log_path.read_text()[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
    steps = _steps(run_dir)
    assert [s["step"] for s in steps] == list(range(1, total + 1))  # none lost, none trained twice
    assert steps[-1]["health/global_restarts"] >= 1
    assert steps[-1]["samples/trained"] == 16 * total
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"


def test_colocate_engines_survive_losing_their_node_and_scale_out_onto_a_joining_one(
    cluster: NetnsCluster, tmp_path: Path
) -> None:
    """One colocate run on three nodes: engine 0 next to the Actor takes shared memory, engine 1 on a worker
    the object store; that worker dies mid-run and engine 1 comes back on the other one; a node joins and
    the scale-out's engine lands on it. Then the control plane's scaling rules over HTTP: conflicts, NOOP,
    cancel, an external engine by URL, protected launch engines, drained and forced scale-in. The run is
    stopped with SIGINT; its steps are contiguous, none lost or trained twice."""
    run_dir = tmp_path / "run"
    # the control plane listens on the head's bridge address, which this process reaches through the bridge
    _sh("ip", "addr", "replace", f"10.{NET}.0.254/24", "dev", cluster.bridge)
    overrides = [o for o in TINY_RUN if not o.startswith(("cluster.", "trainer.sft"))]
    argv = [sys.executable, "-m", "relax_launch", "cluster=ray", f"cluster.address={cluster.address}"]
    argv += [
        *overrides,
        "trainer.sft_warmup_steps=0",
        "rollout.num_engines=2",
        *SPREAD,
        "rollout.max_new_tokens=4",
    ]
    argv += [
        "control_plane.enabled=true",
        f"control_plane.host={cluster.node_ip(0)}",
        f"control_plane.token={TOKEN}",
    ]
    argv += ["trainer.total_steps=100000", "rollout.health_check_interval_s=1", f"hydra.run.dir={run_dir}"]
    log_path = tmp_path / "job.log"
    with open(log_path, "w") as log_file:
        job = cluster.popen(0, argv, stdout=log_file, stderr=subprocess.STDOUT)
    engine_server = None
    try:
        info = run_dir / "control_plane.json"
        _wait(lambda: info.is_file() or job.poll() is not None, 300, "control_plane.json")
        assert job.poll() is None, log_path.read_text()[-3000:]
        headers = {"Authorization": f"Bearer {TOKEN}"}
        http = httpx.Client(base_url=json.loads(info.read_text())["url"], headers=headers, timeout=60)
        _wait(lambda: _steps(run_dir), 300, "the first step")

        def nodes() -> list[str | None]:
            return [e["node"] for e in http.get("/rollout/engines").json()["engines"]]

        def finish(kind: str, rid: str) -> dict:
            def done() -> dict | None:
                state = http.get(f"/rollout/{kind}/{rid}").json()
                return state if state["status"] not in RUNNING else None

            return _wait(done, 180, f"{kind} {rid}")

        # per engine, the channel that reaches it: shared memory on the Actor's node, the object store off it
        head, workers = cluster.node_ip(0), {cluster.node_ip(i): i for i in (1, 2)}
        placed = nodes()
        assert placed[0] == head and placed[1] in workers, placed
        text = log_path.read_text()
        assert f"policy consumer 0 on node {head} (Actor on {head}) <- shared_memory" in text
        assert f"policy consumer 1 on node {placed[1]} (Actor on {head}) <- object_store" in text

        # lose engine 1's node: the engine comes back on the surviving worker, and training goes on
        cluster.kill_node(workers[placed[1]])
        lost_at = len(_steps(run_dir))
        survivor = next(ip for ip in workers if ip != placed[1])
        _wait(lambda: nodes() == [head, survivor], 180, "engine 1 back on the surviving worker")
        _wait(lambda: len(_steps(run_dir)) >= lost_at + 2, 120, "training after the node loss")
        assert (
            f"policy consumer 1 on node {survivor} (Actor on {head}) <- object_store" in log_path.read_text()
        )

        # a node joins (2 CPUs: the engine, and the light actor driving an external engine below); a scale-out
        # puts the new engine on it (nowhere else has room); meanwhile, a conflict
        joined = cluster.node_ip(cluster.add_node(2))
        first = http.post("/rollout/scale_out", json={"num_replicas": 3})
        assert first.status_code == 202, first.text
        rid = first.json()["request_id"]
        assert http.post("/rollout/scale_out", json={"num_replicas": 4}).status_code == 409
        assert http.post("/rollout/scale_in", json={"num_replicas": 2}).status_code == 409
        assert finish("scale_out", rid)["status"] == "ACTIVE"
        engines = http.get("/rollout/engines").json()["engines"]
        assert [(e["kind"], e["node"]) for e in engines] == [
            ("launch", head),
            ("launch", survivor),
            ("scaled", joined),
        ]
        noop = http.post("/rollout/scale_out", json={"num_replicas": 3})
        assert noop.status_code == 200 and noop.json()["status"] == "NOOP"
        # cancelled while CREATING: rolled back
        fourth = http.post("/rollout/scale_out", json={"num_replicas": 4}).json()
        cancelled = http.post(f"/rollout/scale_out/{fourth['request_id']}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "CANCELLED"
        assert len(nodes()) == 3
        assert http.post(f"/rollout/scale_out/{rid}/cancel").status_code == 409  # finished: not cancellable
        assert http.get("/rollout/scale_out/nope").status_code == 404

        # an external engine: a Relax engine server on the head's address (the actor driving it may live on
        # any node), with a token, joined by URL
        port = free_port()
        url = f"http://{head}:{port}"
        engine_server = cluster.popen(
            0,
            [sys.executable, "-m", "relax_core.engines.http_server", "--model", str(run_dir / "model_init")]
            + ["--host", head, "--port", str(port), "--threads", "1", "--token", TOKEN]
            + ["--weights-dir", str(run_dir / "rollout_weights")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait(lambda: _healthy(url), 120, "the external engine server")
        ext = http.post("/rollout/scale_out", json={"engine_urls": [url], "engine_tokens": {url: TOKEN}})
        assert ext.status_code == 202, ext.text
        assert finish("scale_out", ext.json()["request_id"])["status"] == "ACTIVE"
        assert http.post("/rollout/scale_out", json={"engine_urls": [url]}).json()["status"] == "NOOP"
        engines = http.get("/rollout/engines").json()["engines"]
        assert [e["kind"] for e in engines] == ["launch", "launch", "scaled", "external"]
        joined_at = len(_steps(run_dir))
        _wait(
            lambda: any(s.get("rollout/engines_used") == 4 for s in _steps(run_dir)[joined_at:]),
            120,
            "a step on all four engines",
        )
        # launch engines are protected; a dry run names the newest engines first
        low = http.post("/rollout/scale_in", json={"num_replicas": 1})
        assert low.status_code == 400 and "protected" in low.json()["detail"]
        plan = http.post("/rollout/scale_in", json={"num_replicas": 2, "dry_run": True}).json()
        assert plan["engines"] == [engines[3]["id"], engines[2]["id"]]
        assert http.post("/rollout/scale_in", json={"engine_urls": ["http://127.0.0.1:1"]}).status_code == 400
        # scale-in: the external one by URL (drained), then forced down to the launch engines
        out = http.post("/rollout/scale_in", json={"engine_urls": [url]})
        assert finish("scale_in", out.json()["request_id"])["status"] == "COMPLETED"
        out = http.post("/rollout/scale_in", json={"num_replicas": 2, "force": True})  # abort + re-route
        assert finish("scale_in", out.json()["request_id"])["status"] == "COMPLETED"
        assert [e["id"] for e in http.get("/rollout/engines").json()["engines"]] == ["launch-0", "launch-1"]
        assert http.post("/rollout/scale_in", json={"num_replicas": 2}).json()["status"] == "NOOP"
        shrunk_at = len(_steps(run_dir))
        _wait(lambda: len(_steps(run_dir)) >= shrunk_at + 2, 120, "training after scale-in")
        assert http.get("/metrics").json()["step"] >= shrunk_at
        assert http.get("/health").json()["status"] == "ok"
    finally:
        if engine_server is not None:
            engine_server.kill()
            engine_server.wait(timeout=30)
        job.send_signal(signal.SIGINT)
        try:
            job.wait(timeout=120)
        except subprocess.TimeoutExpired:
            job.kill()
    steps = [s["step"] for s in _steps(run_dir)]
    assert steps == list(range(1, len(steps) + 1)), steps  # contiguous: none lost, none trained twice
    assert all(s["rollout/unique_samples"] == s["rollout/num_samples"] == 16 for s in _steps(run_dir))
    assert _steps(run_dir)[-1]["health/role_restarts"] >= 1
