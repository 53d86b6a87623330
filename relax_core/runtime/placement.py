"""Where a role's model lives: its device, and the ranks of a multi-process Actor group.

One helper for every model-holding role (Actor, ActorFwd, Reference, Critic, Teacher, the torch rollout
engine), so "which accelerator did Ray give me" is answered once. The training world size covers both
backends: FSDP data-parallel ranks for ``trainer=torch`` and megatron's TP x PP x CP x DP grid.
"""

from __future__ import annotations

import fcntl
import math
import os
import socket
import struct
import time
import uuid
from typing import Any

import torch

from relax_core.errors import ClusterTooSmall, RelaxUserError
from relax_models.devices import local_cuda_index
from relax_models.ports import free_port


def role_device() -> torch.device:
    """The accelerator Ray assigned to this process, else the CPU.

    Ray narrows ``CUDA_VISIBLE_DEVICES`` to the GPUs of the actor, so its GPU is ``cuda:0``; under
    torchrun ``LOCAL_RANK`` picks the device instead. A role without GPUs sees none and gets the CPU.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_cuda_index(torch.cuda.device_count()))


def gpu_env(num_gpus: float) -> dict[str, str]:
    """Environment a Ray actor given ``num_gpus`` needs so that it sees only the GPUs it was given.

    Ray narrows ``CUDA_VISIBLE_DEVICES`` for an actor with GPUs, but since 2.60 leaves it alone for one with
    none (``RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO`` restores the old narrowing to ""), so such a role would see
    every GPU of its node and ``role_device()`` would put it on ``cuda:0``, another role's GPU. We hide them
    per actor rather than set that flag: it is Ray-version specific, must reach every worker's environment
    and rewrites every accelerator family's variable. Where neither the cluster nor this node has a GPU
    nothing is set, so CPU runs start the same workers as before.
    """
    import ray

    if num_gpus > 0:
        return {}
    has_gpus = ray.cluster_resources().get("GPU", 0.0) > 0 or torch.cuda.device_count() > 0
    return {"CUDA_VISIBLE_DEVICES": ""} if has_gpus else {}


def reserve(
    bundles: list[dict[str, float]],
    name: str,
    timeout_s: float = 120.0,
    shares: str = "rollout.num_cpus/trainer.num_cpus",
) -> Any:
    """A ready PACKed placement group of ``bundles`` named ``name``, or one error saying what is short (and
    that ``shares``, the settings the bundles come from, can be lowered)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    need: dict[str, float] = {}
    for bundle in bundles:
        for resource, amount in bundle.items():
            need[resource] = need.get(resource, 0.0) + amount
    have = ray.cluster_resources()
    short = {k: v for k, v in need.items() if v > have.get(k, 0.0) + 1e-9}
    if short:
        asked = ", ".join(f"{v:g} {k}" for k, v in short.items())
        held = ", ".join(f"{have.get(k, 0.0):g} {k}" for k in short)
        raise ClusterTooSmall(
            f"the roles of {name} need {asked} in Ray but the cluster has {held}: raise cluster.num_cpus/cluster.num_gpus "
            f"or lower {shares} (logical shares, not cores)"
        )
    pg = placement_group(bundles, strategy="PACK", name=name)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise ClusterTooSmall(
            f"Ray could not place {name} {bundles} within {timeout_s:g} s (free: {ray.available_resources()}): "
            "other work holds the resources, or no single node fits a bundle"
        ) from None
    return pg


def bundle_nodes(pg: Any) -> list[str]:
    """The IP of the node that holds each bundle of placement group ``pg``, in bundle order."""
    import ray
    from ray.util.placement_group import placement_group_table

    ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    where = placement_group_table(pg)["bundles_to_node_id"]
    return [ips.get(where[i], where[i]) for i in sorted(where)]


def actor_world_size(trainer_cfg: Any) -> int:
    """Actor processes the trainer needs: ``trainer.dp_size`` FSDP ranks, or the megatron training world."""
    if trainer_cfg.backend == "megatron":
        from relax_models.megatron.launch import training_world_size

        return training_world_size(trainer_cfg.megatron, trainer_cfg.dp_size)
    return int(trainer_cfg.dp_size)


def helper_ranks(trainer_cfg: Any) -> int:
    """Processes of each model role besides the Actor (ActorFwd, Reference, Critic, Teacher): with FSDP
    they are sharded like the Actor, as many ranks in a process group of their own; else one."""
    fsdp = trainer_cfg.backend == "torch" and trainer_cfg.fsdp
    return actor_world_size(trainer_cfg) if fsdp else 1


# names the Ray KV entries through which one group's ranks meet (set per rank by :func:`rank_envs`)
RENDEZVOUS_ENV = "RELAX_RENDEZVOUS"
_KV_NAMESPACE = "relax-rendezvous"


def rank_env(rank: int, world_size: int, rendezvous: str) -> dict[str, str]:
    """The ``torch.distributed`` environment of Actor rank ``rank`` (torchrun's names), less
    ``MASTER_ADDR``/``MASTER_PORT``: :func:`join_rendezvous` sets those in the rank's own process.

    No ``LOCAL_RANK``: Ray shows each GPU actor only its own device, which is then ``cuda:0``.
    """
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), RENDEZVOUS_ENV: rendezvous}


def rank_envs(world_size: int) -> list[dict[str, str]] | None:
    """The environment of each rank of one ``world_size`` group, under a rendezvous name of its own (a
    restarted group meets afresh); None for one."""
    if world_size == 1:
        return None
    name = uuid.uuid4().hex
    return [rank_env(i, world_size, name) for i in range(world_size)]


def join_rendezvous(timeout_s: float = 600.0) -> None:
    """Set ``MASTER_ADDR``/``MASTER_PORT`` of this rank's group, before ``init_process_group``.

    The driver cannot pick them: it does not know where Ray puts rank 0, and a port free on the driver's
    node says nothing of rank 0's. So every rank posts its node's IP (as Ray sees it) to Ray's KV store;
    rank 0 waits for all, picks a port free on its node and posts the address. A group on one node meets on
    127.0.0.1 as before; one spanning nodes on rank 0's node IP. Does nothing outside such a group (a lone
    process, or a test that set the variables itself).
    """
    name = os.environ.get(RENDEZVOUS_ENV)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not name or world == 1:
        return
    import ray
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_put

    rank, ip = int(os.environ["RANK"]), ray.util.get_node_ip_address()
    deadline = time.monotonic() + timeout_s

    def wait_for(key: str) -> str:
        while (value := _internal_kv_get(f"{name}/{key}", namespace=_KV_NAMESPACE)) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {rank} of {world}: no {key} from its group within {timeout_s:g} s")
            time.sleep(0.05)
        return value.decode()

    _internal_kv_put(f"{name}/node{rank}", ip, namespace=_KV_NAMESPACE)
    if rank == 0:
        nodes = {wait_for(f"node{r}") for r in range(world)}
        host = "127.0.0.1" if nodes == {ip} else ip
        port = free_port("")  # rank 0's store listens on every interface of its node
        _internal_kv_put(f"{name}/master", f"{host}:{port}", namespace=_KV_NAMESPACE)
    host, port = wait_for("master").rsplit(":", 1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, port
    if host != "127.0.0.1":
        interface = gloo_interface(ip)
        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface


def gloo_interface(node_ip: str) -> str | None:
    """The network interface gloo must use for ``node_ip`` to be its address, None if it picks it itself.

    Gloo takes the address this host's name resolves to; where that is a loopback address (``/etc/hosts``
    in many containers maps the hostname to 127.0.x.1) it would advertise it to ranks on other nodes, which
    cannot reach it. Then the interface holding Ray's node IP is named. NCCL needs nothing: it skips
    loopback by itself (and prefers InfiniBand, which naming Ray's interface would override). A
    ``GLOO_SOCKET_IFNAME`` set by the user is kept.
    """
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return None
    try:
        resolved = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    except OSError:
        resolved = set()
    if resolved == {node_ip}:
        return None
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:  # SIOCGIFADDR: the interface's IPv4 address
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
        if socket.inet_ntoa(packed[20:24]) == node_ip:
            return name
    return None


def data_parallel_size(trainer_cfg: Any) -> int:
    """Ranks that each train on their own slice of a batch."""
    if trainer_cfg.backend == "megatron":
        from relax_models.megatron.launch import data_parallel_size as megatron_dp

        return megatron_dp(trainer_cfg.megatron, trainer_cfg.dp_size)
    return int(trainer_cfg.dp_size)


def check_training_ranks(cfg: Any) -> None:
    """One-line errors for rank settings that cannot work (before Ray starts)."""
    t, r = cfg.trainer, cfg.rollout
    if t.dp_size < 1:
        raise RelaxUserError(f"trainer.dp_size={t.dp_size} must be >= 1")
    if t.backend == "torch" and t.dp_size > 1 and not t.fsdp:
        raise RelaxUserError(
            f"trainer.dp_size={t.dp_size} shards the Actor with FSDP: set trainer.fsdp=true (or trainer=fsdp)"
        )
    dp = data_parallel_size(t)
    if dp == 1:
        return
    batches = {"trainer.global_batch_size": t.global_batch_size} if t.global_batch_size else {}
    if not t.global_batch_size:
        batches["rollout.batch_size x rollout.n_samples_per_prompt"] = r.batch_size * r.n_samples_per_prompt
    if t.sft_warmup_steps:
        batches["trainer.sft_batch_size"] = t.sft_batch_size
    for key, size in batches.items():
        if size % dp:
            raise RelaxUserError(
                f"{key}={size} does not divide over {dp} data-parallel ranks (trainer.dp_size)"
            )


def colocate_bundles(rollout_cfg: Any, trainer_cfg: Any) -> list[dict[str, float]]:
    """Colocate's placement-group bundles: bundle i holds rollout engine i (i < num_engines) and Actor rank i
    (i < the Actor's world size), their CPUs and GPUs added up."""
    r, t = rollout_cfg, trainer_cfg
    world = actor_world_size(t)
    bundles = []
    for i in range(max(r.num_engines, world)):
        engines, trainers = int(i < r.num_engines), int(i < world)
        gpu = engines * r.num_gpus + trainers * t.num_gpus
        bundles.append({"CPU": engines * r.num_cpus + trainers * t.num_cpus} | ({"GPU": gpu} if gpu else {}))
    return bundles


def gpu_bundles(cfg: Any) -> list[float]:
    """GPUs of each placement-group bundle the run reserves (what ``modes/colocate.py``,
    ``modes/asynchronous.py`` and the judge ask Ray for; Reference, Critic and Teacher share an Actor rank's
    in colocate)."""
    r, t = cfg.rollout, cfg.trainer
    judge = cfg.reward.judge
    # the judge engines' bundles (relax_core/rollout/judge.py's placement group relax-judge)
    judges = (
        [judge.num_gpus] * judge.num_engines if judge is not None and judge.managed and judge.num_gpus else []
    )
    if cfg.mode.name == "colocate":
        return [bundle.get("GPU", 0.0) for bundle in colocate_bundles(r, t)] + judges
    world = actor_world_size(t)
    from relax_core.algorithms.spec import requirements

    helpers = len(requirements(cfg).model_roles) * helper_ranks(t)
    return [r.num_gpus] * r.num_engines + [t.num_gpus] * (world + helpers) + judges


def cluster_gpus(cluster: Any) -> tuple[str, int, int] | None:
    """(setting, nodes, GPUs per node) the cluster option promises; None when only the running Ray knows
    (``cluster=ray`` / ``slurm_allocation``: ``reserve`` checks there), or no Ray reserves anything
    (``cluster=in_process``). ``cluster=local`` with ``num_gpus: null`` is this machine's GPUs: they bound
    what fits, but do not make a run a GPU run (see :func:`check_gpus`)."""
    if cluster.name == "local":
        detected = cluster.num_gpus is None
        return "cluster.num_gpus", 1, torch.cuda.device_count() if detected else cluster.num_gpus
    if cluster.name == "slurm":
        return "cluster.gpus_per_node", cluster.nodes, cluster.gpus_per_node
    return None


def check_gpus(cfg: Any) -> None:
    """One-line errors for GPU asks the cluster cannot hold (before Ray starts).

    A GPU run is one whose cluster has GPUs or whose trainer or rollout asks for them; this machine's
    GPUs do not count, so a CPU config validates the same anywhere.
    """
    r, t = cfg.rollout, cfg.trainer
    judge_gpus = cfg.reward.judge.num_gpus if cfg.reward.judge is not None else 0.0
    shares = (("rollout.num_gpus", r.num_gpus), ("trainer.num_gpus", t.num_gpus))
    for key, amount in (*shares, ("reward.judge.num_gpus", judge_gpus)):
        if amount < 0 or (amount > 1 and not float(amount).is_integer()):
            raise RelaxUserError(
                f"{key}={amount:g}: Ray gives a share of one GPU or whole GPUs (0 to 1, or 2, 3, ...)"
            )
    shape = cluster_gpus(cfg.cluster)
    # GPUs the config names (a local cluster's detected GPUs leave a CPU config, the default, on the CPU)
    named = shape[2] if shape and getattr(cfg.cluster, "num_gpus", 0) is not None else 0
    if not named and not r.num_gpus and not t.num_gpus:
        return
    why = f"{shape[0]}={named}" if named else "the other roles ask for GPUs"
    for key, amount in (("trainer.num_gpus", t.num_gpus), ("rollout.num_gpus", r.num_gpus)):
        if not amount:
            raise RelaxUserError(
                f"{key}=0 on a GPU run ({why}): the role would run without a GPU of its own; set {key} "
                "(1, or a share such as 0.5 when the Actor and an engine share a GPU)"
            )
    seen = math.ceil(r.num_gpus)  # an engine's server sees every GPU its share touches
    if seen < r.tensor_parallel_size:
        raise RelaxUserError(
            f"rollout.tensor_parallel_size={r.tensor_parallel_size} needs {r.tensor_parallel_size} GPUs per engine "
            f"but rollout.num_gpus={r.num_gpus:g} gives it {seen}: set rollout.num_gpus={r.tensor_parallel_size}"
        )
    if shape is None:
        return
    key, nodes, per_node = shape
    given = f"{key}={per_node}" if named or not per_node else f"{key}=null (this machine's {per_node})"
    free = [float(per_node)] * nodes
    for need in sorted(gpu_bundles(cfg), reverse=True):  # first fit, largest first: how PACK fills nodes
        node = next((n for n, left in enumerate(free) if need <= left + 1e-9), None)
        if node is None:
            asked = sum(gpu_bundles(cfg))
            raise RelaxUserError(
                f"the roles ask for {asked:g} GPUs (bundles of up to {max(gpu_bundles(cfg)):g}) but {given} "
                f"gives {nodes} node(s) {per_node} each: raise {key} or lower rollout.num_engines/rollout.num_gpus/trainer.num_gpus"
                + ("/reward.judge.num_gpus" if judge_gpus else "")
            )
        free[node] -= need
