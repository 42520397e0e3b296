"""A 127.0.0.1 port picked here for another process to bind later (a server's HTTP port, a NIXL side channel, a
gloo rendezvous): the vLLM DI launcher, the benchmarks' process groups and the tests' servers pick them here.

A port picked from the kernel's ephemeral range can be handed, between the pick and the bind, to any socket bound
to port 0 or connecting out: once a DI decode instance's worker took the side-channel port picked for the prefill
instance, whose handshake listener then died, and the pair hung. The kernel hands out no port below the range, so
only another explicit pick can take one of those.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 10000  # below: the ports other services are configured on


def free_port() -> int:
    """A port of 127.0.0.1 free now, below the ephemeral range where there is room (any free port else)."""
    low = ephemeral_low()
    rng = random.Random()
    for _ in range(64 if low >= LOWEST + 2000 else 0):
        port = rng.randrange(LOWEST, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no room below the range (or every try taken): any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (0 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
