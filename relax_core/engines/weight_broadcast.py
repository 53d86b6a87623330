"""The last hop of an in-memory weight update: a state dict broadcast over a torch.distributed group into an
engine server's workers, no disk and no pickled callables.

Relax's side is rank 0 of a group of ``1 + tensor-parallel workers`` (gloo on CPU, NCCL on GPU). The
control messages are SGLang's request shapes, served by SGLang itself and by Relax's vLLM server
(``vllm_server``) alike:

- ``POST /init_weights_update_group`` ``{master_address, master_port, rank_offset, world_size, group_name,
  backend}``: the server's workers join the group as ranks ``rank_offset + tp_rank``;
- ``POST /begin_weight_update`` ``{}``, then per bucket ``POST /update_weights_from_distributed`` ``{names,
  dtypes, shapes, group_name, flush_cache, weight_version}`` (the workers receive one broadcast per named
  tensor, in order, and load them), then ``POST /end_weight_update`` ``{}``: SGLang takes updates only
  inside such a session.

A state dict goes as buckets of at most ``bucket_bytes``, one request per bucket; the last one carries the
version and flushes the server's prefix cache. The group's store keys are those of SGLang's
``init_custom_process_group``, with which SGLang's server joins; this module imports only torch, so Relax's
vLLM worker extension (``vllm_worker_ext``) joins with :func:`join_group`: one path for both engines.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, BackendConfig

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


class WeightBroadcaster:
    """Rank 0 of a weight-transfer group with one engine server; ``post(path, body)`` sends its requests.

    Build it once per server and call :meth:`send` per version; it can be driven from any process that
    holds the tensors (the Rollout role today, the trainer later).
    """

    def __init__(
        self,
        post: Callable[[str, dict[str, Any]], Any],
        server_world_size: int = 1,
        backend: str = "gloo",
        master_address: str = "127.0.0.1",
        bucket_bytes: int = 256 << 20,
        group_name: str = "relax-weights",
    ) -> None:
        self.post = post
        self.backend = backend
        self.bucket_bytes = bucket_bytes
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
        _check(reply.result(), "init_weights_update_group")

    def buckets(self, state_dict: dict[str, torch.Tensor]) -> list[list[tuple[str, torch.Tensor]]]:
        """Consecutive tensors grouped up to ``bucket_bytes`` each (a larger tensor is a bucket alone)."""
        out: list[list[tuple[str, torch.Tensor]]] = [[]]
        size = 0
        for name, tensor in state_dict.items():
            nbytes = tensor.numel() * tensor.element_size()
            if out[-1] and size + nbytes > self.bucket_bytes:
                out.append([])
                size = 0
            out[-1].append((name, tensor))
            size += nbytes
        return out

    def send(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Broadcast every tensor of ``state_dict`` (HF names) and tag the server's weights ``version``.

        The buckets go inside a weight-update session (``/begin_weight_update`` ... ``/end_weight_update``):
        SGLang refuses ``/update_weights_from_distributed`` outside one, before receiving anything, which
        would leave this side's broadcast waiting for the group timeout.
        """
        _check(self.post("/begin_weight_update", {}), "begin_weight_update")
        try:
            self._send_buckets(state_dict, version)
        finally:
            _check(self.post("/end_weight_update", {}), "end_weight_update")

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
            _check(reply.result(), "update_weights_from_distributed")

    def close(self) -> None:
        self.requests.shutdown(wait=False, cancel_futures=True)


def _check(reply: Any, what: str) -> None:
    if isinstance(reply, dict) and not reply.get("success", True):
        raise RuntimeError(f"{what} failed on the engine server: {reply.get('message')}")
