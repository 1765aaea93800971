"""The raw-broadcast reference ``hal sync`` measures each publish against: an add-on to the job, not part of it.

One ``broadcast`` of the same bytes from the trainer's published buffer into every rollout's staging area, on
a group of the engine's backend, just before each publish and after the verification (the mean is the
step's reference), and once after step 0.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import hal
from hal.apps.weightsync.loop import attach_everywhere
from ckpt.manager import UpdateError
from hal.apps.weightsync.figures import raw_figures


class RawMember:
    """A worker's side of the raw reference (an add-on: see :meth:`Worker.attach`)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.store: Any = None
        self.group: Any = None

    def host(self) -> tuple[str, int]:
        """Host the raw group's rendezvous store (once) where this worker runs; returns ``(address, port)``."""
        if self.store is None:
            self.store = hal.connect_store(self.worker.where().node_ip, 0, 0, 1, self.worker.options.timeout)
        return self.worker.where().node_ip, int(self.store.port)

    def join(self, addr: str, port: int, rank: int, world_size: int, generation: int) -> None:
        """Be rank ``rank`` of generation ``generation`` of the raw group at ``addr:port``; blocks until every member
        joined, at most the job's timeout."""
        self.close()
        timeout = self.worker.options.timeout
        if self.store is None:
            self.store = hal.connect_store(addr, port, rank, world_size, timeout)
        self.group = hal.new_group_from_store(self.store, rank, world_size, self.worker.kind, timeout,
                                              f"raw/{generation}")

    async def broadcast(self) -> tuple[float, float]:
        """One broadcast of the published bytes from the trainer; returns its wall-clock start and end."""
        start = time.time()
        await asyncio.to_thread(self.group.broadcast, self.worker.raw_buffer(), 0)
        return start, time.time()

    def close(self) -> None:
        """Leave the group (the store stays for the next generation)."""
        if self.group is not None:
            self.group.close()
            self.group = None


class RawReference:
    """The job's hook measuring the raw reference of each step; a failed broadcast fails the step, and the
    next step forms a new generation of the group."""

    def __init__(self) -> None:
        self.generation = 0
        self.wanted = 1
        self.attached: set[int] = set()
        self.samples: dict[int, list[float]] = {}

    async def ensure_group(self, job: Any) -> None:
        """Attach the raw add-on where it is missing and form the wanted generation of the group."""
        manager = job.manager
        everyone = await attach_everywhere(manager, self.attached, RawMember, "raw group")
        if self.generation == self.wanted:
            return
        [(addr, port)] = await manager.call([0], RawMember.host, what="raw group")
        try:
            await manager.call(everyone, RawMember.join, [(addr, port, rank, len(everyone), self.wanted)
                                                         for rank in everyone], what="raw group")
        except UpdateError:
            self.broken()
            raise
        self.generation = self.wanted

    def broken(self) -> None:
        """The group failed (a member died or timed out): the next step forms a new generation."""
        self.wanted = max(self.wanted, self.generation) + 1

    async def measure(self, job: Any) -> float:
        """One raw broadcast to every rollout, in seconds."""
        await self.ensure_group(job)
        manager = job.manager
        try:
            spans = await manager.call(list(range(manager.world_size)), RawMember.broadcast, what="raw broadcast")
        except UpdateError:
            self.broken()
            raise
        return max(end for _, end in spans[1:]) - max(start for start, _ in spans)

    async def before_publish(self, job: Any, global_steps: int) -> None:
        self.samples[global_steps] = [await self.measure(job)]

    async def after_publish(self, job: Any, global_steps: int) -> None:
        self.samples.setdefault(global_steps, []).append(await self.measure(job))

    def figures(self, global_steps: int, nbytes: int, publish_s: float) -> dict[str, Any]:
        """Step 0: ``{"raw_s"}``; a step: :func:`~hal.apps.weightsync.figures.raw_figures` of its two broadcasts."""
        each = self.samples.pop(global_steps, [])
        if global_steps == 0:
            return {"raw_s": sum(each) / len(each)}
        return raw_figures(nbytes, publish_s, each)

    def members_changed(self, index: int) -> None:
        self.attached.discard(index)
        self.wanted = self.generation + 1


__all__ = ["RawMember", "RawReference"]
