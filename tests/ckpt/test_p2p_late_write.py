"""A write of a failed update that lands late must not reach what a later update serves (found by ``hal soak``:
mooncake served bytes the trainer never published for that step).

Over a cut link a transfer library's write does not die with the update that gave it up: TCP retransmits it
once the link is back, and Mooncake's tcp server writes it wherever its header points. Before the fix a rollout
kept its agent and its receive slots after a failed update, so that write landed in a slot of the next update
between the library's write and the consumer's copy. Now a rollout that drops a connection closes its agent
(the library stops writing into its memory) and connects again with new slots.

The library here is an in-process one that can hold a write and land it later, and whose closed agent lands
nothing more: what Mooncake's and NIXL's agents do when closed (their destructors stop their servers).
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
from typing import Any

import pytest
import torch

import ckpt
import hal
from ckpt.p2p import P2PCheckpointEngine, Transport
from ckpt.testing import collect, standalone_pair

TIMEOUT = 2.0
"""The engines' timeout, seconds: the held write makes update 2 fail after it."""
BUCKET = 64 << 10


class Library:
    """The agents of one test and the writes held back (``hold``: writes started from now on are held)."""

    def __init__(self) -> None:
        self.agents: dict[str, HeldTransport] = {}
        self.names = itertools.count()
        self.hold = False
        self.held: list[tuple[HeldTransport, list[tuple[int, bytes]]]] = []
        self.landed = 0  # held writes that reached an open agent's memory

    def land_held(self) -> None:
        """Deliver every held write whose target agent is still open (a closed agent's server is gone)."""
        for target, parts in self.held:
            if not target.closed:
                for address, data in parts:
                    ctypes.memmove(address, data, len(data))
                self.landed += 1
        self.held = []


class HeldTransport(Transport):
    """One agent of :class:`Library`: writes copy at once (``poll`` is done) unless the library holds them."""

    library = "held-writes library"

    def __init__(self, lib: Library) -> None:
        self.lib, self.name, self.closed = lib, f"agent-{next(lib.names)}", False
        self.peers: dict[int, str] = {}
        lib.agents[self.name] = self

    def register(self, buffer: torch.Tensor) -> dict[str, Any]:
        self.addr = buffer.data_ptr()
        return {"name": self.name}

    def add_peer(self, peer: int, info: dict[str, Any]) -> None:
        self.peers[peer] = info["name"]

    def register_source(self, tensor: torch.Tensor) -> Any:
        return tensor

    def release_source(self, handle: Any) -> None:
        pass

    def start_write(self, peer: int, pieces: list[tuple[int, int, int]]) -> Any:
        target = self.lib.agents[self.peers[peer]]
        parts = [(target.addr + offset, ctypes.string_at(address, n)) for address, offset, n in pieces]
        if self.lib.hold:
            self.lib.held.append((target, parts))
            return False  # never completes: the trainer's wait times out
        for address, data in parts:
            ctypes.memmove(address, data, len(data))
        self.lib.land_held()  # a late write arrives after this update's, before the rollout reads the slot
        return True

    def poll(self, handle: Any) -> bool:
        return handle

    def close(self) -> None:
        self.closed = True


class HeldWritesEngine(P2PCheckpointEngine):
    """The transfer-library engine over :class:`HeldTransport`."""

    library: Library

    @classmethod
    def availability(cls) -> hal.Availability:
        return hal.Availability.available()

    def make_transport(self, host: str, in_place: str | None) -> Transport:
        return HeldTransport(self.library)


def _weights(step: int) -> list[tuple[str, torch.Tensor]]:
    """Two 16 KiB tensors (one bucket) whose values name the step."""
    return [(f"w{i}", torch.full((4096,), float(step * 10 + i))) for i in range(2)]


@pytest.mark.hal_device("cpu")  # the engine's connection logic, the same on every kind
def test_a_failed_updates_write_landing_late_does_not_reach_the_next_update():
    lib = Library()
    HeldWritesEngine.library = lib
    trainer, rollout = standalone_pair(HeldWritesEngine, device="cpu", timeout=TIMEOUT, bucket_size=BUCKET)
    adapter = ckpt.InMemoryRolloutAdapter()
    worker = ckpt.CheckpointEngineWorker(rollout, adapter)

    async def update(step: int) -> tuple[BaseException | None, BaseException | None]:
        sent, received = await asyncio.gather(trainer.send_weights(iter(_weights(step)), step),
                                              worker.update_weights(step), return_exceptions=True)
        return (sent if isinstance(sent, BaseException) else None,
                received if isinstance(received, BaseException) else None)

    async def main():
        assert await update(1) == (None, None)
        lib.hold = True  # update 2's write never completes in time: it is still on its way when the update fails
        sent, received = await update(2)
        lib.hold = False
        assert isinstance(sent, ckpt.TransferError) and "rollout rank 1" in str(sent), sent
        assert isinstance(received, ckpt.TransferError), received
        assert adapter.served_step == 1 and len(lib.held) == 1
        assert await update(3) == (None, None)  # update 2's held write arrives during update 3's write

    try:
        asyncio.run(main())
    finally:
        trainer.close()
        rollout.close()
    served = adapter.state_dict()
    assert adapter.served_step == 3
    for name, tensor in _weights(3):
        assert torch.equal(served[name], tensor), (name, served[name][:4])
    assert lib.held == [] and lib.landed == 0  # it arrived at the agent the rollout had closed, not in a slot


class UnreadableHelloTransport(HeldTransport):
    """A trainer's agent that cannot use any rollout's agent metadata (as UCX refusing a connection)."""

    def add_peer(self, peer: int, info: dict[str, Any]) -> None:
        raise ValueError("the rollout's agent metadata is unreadable")


class UnreadableHelloEngine(HeldWritesEngine):
    def make_transport(self, host: str, in_place: str | None) -> Transport:
        return UnreadableHelloTransport(self.library)


@pytest.mark.hal_device("cpu")
def test_a_hello_the_trainer_cannot_use_is_named_when_its_wait_times_out():
    """A CI run once ended "waited 60 s for rollout rank(s) [1] to connect; they are dead, missing or
    misconfigured" while rank 1 had said hello: the trainer's transport could not use it, and said nothing."""
    UnreadableHelloEngine.library = Library()
    trainer, rollout = standalone_pair(UnreadableHelloEngine, device="cpu", timeout=TIMEOUT, bucket_size=BUCKET)

    async def main():
        return await asyncio.gather(trainer.send_weights(iter(_weights(1)), 1), collect(rollout.receive_weights(1)),
                                    return_exceptions=True)
    try:
        sent, _ = asyncio.run(main())
    finally:
        trainer.close()
        rollout.close()
    assert isinstance(sent, ckpt.TransferTimeoutError), sent
    assert "rollout rank 1's last hello could not be used: ValueError: the rollout's agent metadata is unreadable" \
        in str(sent), sent
