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


def test_a_host_whose_ephemeral_range_covers_every_port_gets_a_kernel_chosen_port(monkeypatch) -> None:
    import relax_models.ports as ports

    monkeypatch.setattr(ports, "_ephemeral_range", lambda: (1024, 65535))
    port = ports.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
