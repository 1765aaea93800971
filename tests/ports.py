"""Ports for tests of networked code: one that was free a moment ago, one held busy."""

from __future__ import annotations

import contextlib
import errno
import random
import socket
from typing import Iterable, Iterator


@contextlib.contextmanager
def held_port(host: str = "127.0.0.1") -> Iterator[int]:
    """Hold a TCP port on ``host`` in use (listening) for the ``with`` block; yields its number."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind((host, 0))
        busy.listen()
        yield busy.getsockname()[1]


# Where Linux keeps the range it draws the local port of every outgoing connection from (ip-sysctl).
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"

_LOWEST_PICKED_PORT = 10_000  # well above the registered ports services are commonly configured on
# its own generator, seeded by the OS: processes that seeded `random` alike must not draw the same ports, and
# picking a port must not move the caller's `random` stream (ranks seeded alike would drift apart)
_port_random = random.SystemRandom()


def ephemeral_port_range() -> tuple[int, int] | None:
    """Return the kernel's inclusive ``(low, high)`` ephemeral port range, or ``None`` where it cannot be read."""
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            low, high = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return None
    return low, high


def first_bindable_port(host: str, candidates: Iterable[int]) -> int | None:
    """Return the first of ``candidates`` that a TCP socket on ``host`` (IPv4) can bind now, or ``None``."""
    for port in candidates:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    continue
                raise
            return port
    return None


def pick_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` (IPv4) that was free a moment ago, drawn below the kernel's ephemeral range.

    Ports in the ephemeral range can be taken by any outgoing connection before the server binds (it failed a CI
    run); port 0 is used only where that range is unreadable or full.
    """
    span = ephemeral_port_range()
    if span is not None and span[0] > _LOWEST_PICKED_PORT:
        candidates = range(_LOWEST_PICKED_PORT, span[0])
        port = first_bindable_port(host, _port_random.sample(candidates, k=min(64, len(candidates))))
        if port is not None:
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
