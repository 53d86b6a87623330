"""Rendezvous ports: free, distinct, and out of reach of outgoing connections."""

from __future__ import annotations

import socket

from relax_models.ports import RAY_WORKER_PORTS_END, _ephemeral_range, free_port


def test_ports_are_distinct_bindable_and_outside_the_ephemeral_and_ray_worker_ranges() -> None:
    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(p > RAY_WORKER_PORTS_END and not low <= p <= high for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))
