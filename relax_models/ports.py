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


def _bound_port(host: str, port: int) -> int | None:
    """The port a socket gets when bound to ``(host, port)`` (0: the kernel's choice), None if it cannot."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return None
        return s.getsockname()[1]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now ("" for every interface of this node), outside the ephemeral
    range, never one this process handed out before."""
    candidates = _candidate_ports()
    if len(candidates) < 1000:  # the ephemeral range covers (nearly) every port: let the kernel choose
        candidates = range(1)  # port 0
    for _ in range(200):
        port = _bound_port(host, _draw.choice(candidates))
        if port is not None and port not in _given:
            _given.add(port)
            return port
    raise RuntimeError(
        f"no free TCP port on {host or 'any interface'} in {candidates.start}-{candidates.stop - 1}"
    )
