"""Ports picked for another process to bind later (neffbuild/ports.py): the DI launcher's, the benchmarks' and
the tests' servers'."""

from __future__ import annotations

import socket

from neffbuild.ports import LOWEST, ephemeral_low, free_port


def test_picked_ports_are_free_and_below_the_ephemeral_range():
    """Below the kernel's ephemeral range no socket bound to port 0 (another instance's worker, a client) can take
    a picked port before its process binds it."""
    low = ephemeral_low()
    ports = [free_port() for _ in range(20)]
    assert low < LOWEST + 2000 or all(LOWEST <= p < low for p in ports), (low, ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free when picked: binds
