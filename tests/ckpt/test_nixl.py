"""NIXL's transport against the library itself: an endpoint UCX failed while the peer's agent lives.

Found by ``hal soak`` (nixl on npu-sim, seed 2, once in seven runs under load): after a trainer stopped past the
timeout, the next update's first write to a rollout that was alive and waiting failed to start with
``NIXL_ERR_REMOTE_DISCONNECT``. UCX fails an endpoint for good when its connection is reset (or a keepalive is
missed); nothing but a new endpoint reaches that peer again. Here the agents' TCP connections are reset by hand,
both agents alive, and the next write must land.
"""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch

import ckpt
from ckpt.errors import TransferError

NBYTES = 64 << 10


def _sockets() -> set[int]:
    """This process's open socket file descriptors."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                found.add(int(name))
        except OSError:  # closed meanwhile
            pass
    return found


def _reset(fds: set[int]) -> None:
    """Shut both directions of each socket down (the library keeps its descriptors; UCX reads a reset)."""
    for fd in fds:
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # not a connected socket
            pass


def _write(transport, source: torch.Tensor) -> None:
    """Post one WRITE of ``source`` to peer 1's region at offset 0 and wait until it is done (10 s at most)."""
    handle = transport.start_write(1, [(source.data_ptr(), 0, source.numel())])
    deadline = time.monotonic() + 10
    while not transport.poll(handle):
        if time.monotonic() > deadline:
            raise TimeoutError("the NIXL write did not complete in 10 s")
        time.sleep(0.001)


@pytest.fixture
def tcp_agents(monkeypatch):
    """Two NIXL agents of this process on UCX's tcp transport only (so a reset connection fails the endpoint):
    ``(writer, target_transport, source, target)``, the target's region registered and added to the writer."""
    ok, reason = ckpt.checkpoint_engine_availability("nixl")
    if not ok:
        pytest.skip(f"nixl: {reason}")
    from ckpt.nixl import HOST_MEMORY_TYPE, NixlTransport

    monkeypatch.setenv("UCX_TLS", "tcp")
    writer = NixlTransport("writer", HOST_MEMORY_TYPE, ("UCX",))
    reader = NixlTransport("reader", HOST_MEMORY_TYPE, ("UCX",))
    source = torch.arange(NBYTES, dtype=torch.int64).to(torch.uint8)
    target = torch.zeros(NBYTES, dtype=torch.uint8)
    writer.register(source)
    info = reader.register(target)
    yield writer, info, source, target
    writer.close()
    reader.close()


@pytest.mark.hal_device("cpu")  # the library's endpoints, the same on every kind
@pytest.mark.timeout(60)
def test_a_write_reaches_a_live_peer_whose_endpoint_ucx_failed(tcp_agents):
    writer, info, source, target = tcp_agents
    before = _sockets()
    writer.add_peer(1, info)
    _write(writer, source)
    assert torch.equal(target, source)
    connections = _sockets() - before
    assert connections, "the write opened no connection: UCX did not use its tcp transport"

    _reset(connections)
    time.sleep(0.5)  # UCX's progress reads the reset
    target.zero_()
    _write(writer, source)  # without a new endpoint: NIXL_ERR_REMOTE_DISCONNECT
    assert torch.equal(target, source)


@pytest.mark.hal_device("cpu")
@pytest.mark.timeout(60)
def test_a_write_to_a_peer_whose_agent_closed_still_fails(tcp_agents):
    """The second post is no mask: a peer really gone fails it too, and the error names the library's."""
    from ckpt.nixl import HOST_MEMORY_TYPE, NixlTransport

    writer, _, source, _ = tcp_agents
    gone = NixlTransport("gone", HOST_MEMORY_TYPE, ("UCX",))
    gone_info = gone.register(torch.zeros(NBYTES, dtype=torch.uint8))
    writer.add_peer(1, gone_info)
    gone.close()
    time.sleep(0.5)
    with pytest.raises(TransferError, match="nixl"):  # the library's own error, named
        _write(writer, source)
