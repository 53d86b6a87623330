"""TCP ports for rendezvous and local servers (process groups, weight sync, engine HTTP servers).

A port is chosen some seconds before its server binds it (the driver picks a process group's port, the
group's rank 0 binds it once Ray has started it). A port from the kernel's ephemeral range can be taken in
that window by any outgoing connection, and Ray opens many; so ports are drawn from below that range and
above Ray's worker ports (10002-19999 by default), where only an explicit bind can take them.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

RAY_WORKER_PORTS_END = 19999
_draw = random.SystemRandom()  # independent of any seed an experiment sets
_given: set[int] = set()  # two groups set up by one process must not share a port


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _candidate_ports() -> range:
    low, high = _ephemeral_range()
    if low - RAY_WORKER_PORTS_END > 1000:
        return range(RAY_WORKER_PORTS_END + 1, low)
    return range(high + 1, 65536)  # a host whose ephemeral range starts low: the ports above it


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now ("" for every interface of this node), outside the ephemeral
    range, never one this process handed out before."""
    candidates = _candidate_ports()
    if len(candidates) < 1000:  # the ephemeral range covers (nearly) every port: let the kernel choose
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    for _ in range(200):
        port = _draw.choice(candidates)
        if port not in _given and _bindable(host, port):
            _given.add(port)
            return port
    raise RuntimeError(
        f"no free TCP port on {host or 'any interface'} in {candidates.start}-{candidates.stop - 1}"
    )
