"""Rollout engines on other nodes than the Actor: each gets the weights through the channel that reaches it,
an engine's node dying mid-run is survived (the engine comes back on a surviving node), and a node joining
mid-run takes the engine a scale-out adds. Three nodes in network namespaces (``netns_cluster.py``): each
has its own /dev/shm, so shared memory that crossed nodes would hand an engine zeros."""

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

NET = 82
TOKEN = "multinode-engines"
RUNNING = ("PENDING", "CREATING", "CONNECTING", "HEALTH_CHECKING", "WEIGHT_SYNCING", "DRAINING", "REMOVING")
# Ray's GCS declares a node dead after period x threshold without a health check (15 s by default)
SPREAD = ["rollout.num_cpus=1", "trainer.num_cpus=1"]
FAST_NODE_DEATH = {"RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "3"}


@pytest.fixture
def cluster() -> Iterator[NetnsCluster]:
    reason = skip_reason()
    if reason:
        pytest.skip(f"no multi-node cluster: {reason}")
    # with a CPU per engine and per Actor rank (SPREAD) the head holds bundle 0 (engine 0 + the Actor),
    # engine 1 goes to a worker, and the other worker stays free: room for one engine after a node is lost
    with NetnsCluster(cpus=[2, 1, 1], net=NET, ray_env=FAST_NODE_DEATH) as nodes:
        yield nodes


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

    run_dir, total = tmp_path / "run", 30
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
