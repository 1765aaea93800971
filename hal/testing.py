"""Helpers for tests of networked code. The process harness itself is :mod:`hal.multiprocess`."""

from __future__ import annotations

import contextlib
import socket
from typing import Iterator


@contextlib.contextmanager
def held_port(host: str = "127.0.0.1") -> Iterator[int]:
    """Hold a TCP port on ``host`` in use (listening) for the ``with`` block; yields its number."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind((host, 0))
        busy.listen()
        yield busy.getsockname()[1]
