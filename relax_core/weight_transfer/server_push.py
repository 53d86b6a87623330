"""Server push: the last hop of a weight update, from Relax into an engine server it drives over HTTP
(vLLM, SGLang or Relax's own server), chosen by ``rollout.server_weight_update``:

==============  ==============================================================================
name            how a version reaches the server
==============  ==============================================================================
distributed     in memory: a broadcast over a torch.distributed group the server's workers join
disk            an HF folder per version that the server reloads by path (it shares the filesystem)
==============  ==============================================================================

The channels of :mod:`relax_core.weight_transfer` bring a version to the role that drives the server (the
Rollout); its :class:`~relax_core.engines.client.HttpEngine` hands it on through one :class:`ServerPush`.

The control messages are SGLang's request shapes, served by SGLang itself and by Relax's vLLM server
(``engines/vllm_server``) alike:

- ``POST /init_weights_update_group`` ``{master_address, master_port, rank_offset, world_size, group_name,
  backend}``: the server's workers join the group as ranks ``rank_offset + tp_rank``;
- ``POST /begin_weight_update`` ``{}``, then per bucket ``POST /update_weights_from_distributed`` ``{names,
  dtypes, shapes, group_name, flush_cache, weight_version}`` (the workers receive one broadcast per named
  tensor, in order, and load them), then ``POST /end_weight_update`` ``{}``: SGLang takes updates only
  inside such a session;
- ``POST /update_weights_from_disk`` ``{model_path, weight_version}``.

The group's store keys are those of SGLang's ``init_custom_process_group``, with which SGLang's server
joins; the server side of this module needs only torch, so Relax's vLLM worker extension
(``engines/vllm_worker_ext``) joins with :func:`join_group`: one path for both engines.
"""

from __future__ import annotations

import abc
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, BackendConfig

from relax_core.config.options import Option
from relax_core.weight_transfer.channel import layout_of, plan_buckets
from relax_core.weight_transfer.disk import save_weights_folder

# ``post(path, body)``: one request to the server, its JSON reply
Post = Callable[[str, dict[str, Any]], Any]


@dataclass
class ServerSide:
    """What a push needs to know of its server: its tensor-parallel workers (the group's other ranks), the
    base model folder (a pushed folder copies its config and tokenizer) and where it may read folders
    (``None``: a new temporary folder; a guarded server reads only its ``--weights-dir`` folders)."""

    world_size: int = 1
    base_model_path: str | None = None
    weights_dir: str | None = None


# generous: the first join waits for the server side to receive the request
GROUP_TIMEOUT = timedelta(seconds=300)


def join_group(
    master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str
) -> dist.ProcessGroup:
    """Join the group whose rank 0 hosts the rendezvous store at ``master_address:master_port``."""
    store = dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=GROUP_TIMEOUT)
    return _group(store, rank, world_size, group_name, backend)


def _group(store: dist.Store, rank: int, world_size: int, group_name: str, backend: str) -> dist.ProcessGroup:
    """The group with the store keys of SGLang's ``init_custom_process_group``, so an SGLang server joins with
    its own code: it wraps the rendezvous store in ``PrefixStore(group_name)`` and passes it to torch's
    ``_new_process_group_helper``, which prefixes the keys again with ``<group_name>/`` and then the backend's
    device (``cpu/`` for gloo, ``cuda/`` for nccl). Built here without that helper: it registers the group
    in torch's per-process registry (one name per process, where a test plays both sides) and, where the
    default group is bound to a GPU (a trainer), splits the new communicator off that group's."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight-transfer backend {backend!r} is not gloo or nccl")
    # the helper's device: the first of the backend's devices, as torch's BackendConfig lists them
    device = next(iter(BackendConfig(Backend(backend)).get_device_backend_map()))
    store = dist.PrefixStore(
        f"{device}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    )
    if backend == "gloo":
        group = dist.ProcessGroupGloo(store, rank, world_size, GROUP_TIMEOUT)
    else:
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = GROUP_TIMEOUT
        group = dist.ProcessGroupNCCL(store, rank, world_size, options)
    # as the helper does: gloo's rank 0 publishes the sequence number the other ranks wait to read
    group._set_sequence_number_for_group()
    return group


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (what ``getattr(torch, name)`` reads back)."""
    return str(dtype).removeprefix("torch.")


def check_reply(reply: Any, what: str) -> None:
    """Raise when the server answered ``{"success": false}`` to request ``what``."""
    if isinstance(reply, dict) and not reply.get("success", True):
        raise RuntimeError(f"{what} failed on the engine server: {reply.get('message')}")


class ServerPush(abc.ABC):
    """Moves each version of the policy's weights into one engine server."""

    @classmethod
    @abc.abstractmethod
    def open(cls, post: Post, server: ServerSide) -> ServerPush:
        """The push into the server ``post`` reaches, described by ``server``."""

    @abc.abstractmethod
    def push(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load ``state_dict`` (HF names) into the server and tag its weights ``version``."""

    def close(self) -> None:
        """Release what the push holds (a thread, a folder)."""


class DistributedPush(ServerPush):
    """Rank 0 of a weight-transfer group with one engine server, formed when it is built (the server must
    be serving by then); each version goes as buckets of about ``bucket_mb`` MiB, one request per bucket,
    the last one carrying the version and flushing the server's prefix cache."""

    def __init__(
        self,
        post: Post,
        server_world_size: int = 1,
        backend: str = "gloo",
        master_address: str = "127.0.0.1",
        bucket_mb: float = 256.0,
        group_name: str = "relax-weights",
    ) -> None:
        self.post = post
        self.bucket_mb = bucket_mb
        self.group_name = group_name
        self.device = torch.device("cuda" if backend == "nccl" else "cpu")
        # the server's side blocks inside its request until the group forms, so requests go from a thread
        self.requests = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-broadcast")
        world_size = 1 + server_world_size
        # rank 0 hosts the rendezvous store on a port the OS picks
        store = dist.TCPStore(
            master_address, 0, world_size, is_master=True, timeout=GROUP_TIMEOUT, wait_for_workers=False
        )
        reply = self.requests.submit(
            post,
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": store.port,
                "rank_offset": 1,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )
        self.group = _group(store, 0, world_size, group_name, backend)
        check_reply(reply.result(), "init_weights_update_group")

    @classmethod
    def open(cls, post: Post, server: ServerSide) -> DistributedPush:
        return cls(post, server_world_size=server.world_size)

    def buckets(self, state_dict: dict[str, torch.Tensor]) -> list[list[tuple[str, torch.Tensor]]]:
        """Consecutive same-dtype tensors grouped up to ``bucket_mb`` each (a larger one is a bucket
        alone)."""
        items = list(state_dict.items())
        return [[items[i] for i in bucket] for bucket in plan_buckets(layout_of(state_dict), self.bucket_mb)]

    def push(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Broadcast every tensor of ``state_dict`` inside a weight-update session (``/begin_weight_update``
        ... ``/end_weight_update``): SGLang refuses ``/update_weights_from_distributed`` outside one, before
        receiving anything, which would leave this side's broadcast waiting for the group timeout."""
        check_reply(self.post("/begin_weight_update", {}), "begin_weight_update")
        try:
            self._send_buckets(state_dict, version)
        finally:
            check_reply(self.post("/end_weight_update", {}), "end_weight_update")

    def _send_buckets(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        buckets = self.buckets(state_dict)
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            body = {
                "names": [name for name, _ in bucket],
                "dtypes": [dtype_name(t.dtype) for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
                "group_name": self.group_name,
                "flush_cache": last,
                "weight_version": str(version) if last else None,
            }
            reply = self.requests.submit(self.post, "/update_weights_from_distributed", body)
            for _, tensor in bucket:
                self.group.broadcast(tensor.detach().to(self.device).contiguous(), 0).wait()
            check_reply(reply.result(), "update_weights_from_distributed")

    def close(self) -> None:
        self.requests.shutdown(wait=False, cancel_futures=True)


class FolderPush(ServerPush):
    """Each version as an HF folder under ``weights_dir`` (default a new temporary folder; for a guarded
    server, one of its ``--weights-dir`` folders) that the server reloads by path; the previous version's
    folder is deleted once the server has loaded the new one."""

    def __init__(
        self, post: Post, base_model_path: str | None = None, weights_dir: str | None = None
    ) -> None:
        self.post = post
        self.base_model_path = base_model_path
        self._tmp = None if weights_dir else tempfile.TemporaryDirectory(prefix="relax-weights-")
        self.root = Path(weights_dir or self._tmp.name)  # type: ignore[union-attr]
        self._last: Path | None = None

    @classmethod
    def open(cls, post: Post, server: ServerSide) -> FolderPush:
        return cls(post, base_model_path=server.base_model_path, weights_dir=server.weights_dir)

    def push(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        folder = save_weights_folder(state_dict, self.base_model_path, self.root / f"v{version}")
        load_folder(self.post, str(folder), version)
        if self._last is not None and self._last != folder:
            shutil.rmtree(self._last, ignore_errors=True)
        self._last = folder

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()


def load_folder(post: Post, path: str, version: int) -> None:
    """Have the server reload its weights from the HF folder ``path`` and tag them ``version``."""
    reply = post("/update_weights_from_disk", {"model_path": path, "weight_version": str(version)})
    if not reply.get("success", False):
        raise RuntimeError(f"the engine server refused weights from {path}: {reply.get('message')}")


SERVER_PUSHES = Option(
    "rollout.server_weight_update",
    {
        "distributed": "relax_core.weight_transfer.server_push:DistributedPush",
        "disk": "relax_core.weight_transfer.server_push:FolderPush",
    },
)


def server_push(name: str, post: Post, server: ServerSide) -> ServerPush:
    """The :class:`ServerPush` ``name`` (``rollout.server_weight_update``) into the server that ``post``
    reaches."""
    return SERVER_PUSHES.load(name).open(post, server)
