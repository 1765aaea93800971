"""An in-process :class:`ckpt.reshard.transfer.Channel` for tests: every rank a task of one event loop.

Point-to-point semantics as gloo's: a send and a receive between a pair match in the order each side posted them,
sizes must agree, and a send completes only once its receive matched it (the sender's buffer is read then, so a
sender that refills a buffer before its send completed sends the new bytes, as over a real transport)."""

from __future__ import annotations

import asyncio
import collections
import time

import torch

from ckpt.errors import TransferError, TransferTimeoutError
from ckpt.reshard.transfer import PairBuffers, Posted


class Work:
    def __init__(self) -> None:
        self.done = False
        self.error: str | None = None


class Hub:
    def __init__(self) -> None:
        self.sends: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
        self.recvs: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
        self.dead: set[int] = set()
        self.log: list[tuple[int, int, int]] = []  # (src, dst, nbytes) of every completed transfer

    def match(self, src: int, dst: int) -> None:
        sends, recvs = self.sends[(src, dst)], self.recvs[(src, dst)]
        while sends and recvs:
            (stensor, swork), (rtensor, rwork) = sends.popleft(), recvs.popleft()
            a = stensor.reshape(-1).view(torch.uint8)
            b = rtensor.view(torch.uint8).reshape(-1) if rtensor.is_contiguous() else None
            if a.numel() != rtensor.numel() * rtensor.element_size():
                swork.error = rwork.error = f"size mismatch {a.numel()} -> {rtensor.numel() * rtensor.element_size()}"
            else:
                b.copy_(a)
                self.log.append((src, dst, a.numel()))
            swork.done = rwork.done = True


class FakeChannel:
    def __init__(self, hub: Hub, rank: int, timeout: float = 5.0) -> None:
        self.hub, self.rank, self.timeout = hub, rank, timeout
        self.device = torch.device("cpu")
        self.buffers = PairBuffers()

    def send(self, tensor: torch.Tensor, peer: int) -> Work:
        work = Work()
        self.hub.sends[(self.rank, peer)].append((tensor, work))
        self.hub.match(self.rank, peer)
        return work

    def recv(self, tensor: torch.Tensor, peer: int) -> Work:
        work = Work()
        self.hub.recvs[(peer, self.rank)].append((tensor, work))
        self.hub.match(peer, self.rank)
        return work

    def bucket(self, peer: int, slot: int, nbytes: int) -> torch.Tensor:
        return self.buffers.get(peer, slot, nbytes, self.device)

    def send_bucket(self, source: torch.Tensor, peer: int, slot: int) -> Work:
        return self.send(source, peer)

    def recv_bucket(self, into, peer: int, slot: int, nbytes: int) -> Posted:
        buffer = into if into is not None else self.buffers.get(peer, slot, nbytes, self.device)[:nbytes]
        return Posted(self.recv(buffer, peer), buffer, into is not None)

    def release(self, posted, peer: int, slot: int) -> None:
        pass

    async def wait(self, works: list, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        for w in works:
            w = w.work if isinstance(w, Posted) else w
            while not w.done:
                if self.rank in self.hub.dead:
                    raise TransferError(f"{what}: rank {self.rank} is dead")
                if time.monotonic() > deadline:
                    raise TransferTimeoutError(f"{what}: rank {self.rank} timed out")
                await asyncio.sleep(0.001)
            if w.error:
                raise TransferError(f"{what}: {w.error}")
