"""Benchmarks: each prints ratios measured side by side in one run (the machine is shared and noisy).

``hal bench`` chooses them and their sizes; each module offers ``run(...) -> dict`` and ``print_table(dict)``
and imports nothing from the command line. Ranks start through :mod:`hal.apps.benchmarks.ranks`; the
weight-sync job is reached through :mod:`hal.apps.benchmarks.job`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Sequence


def timed_once(group: Any, fn: Callable[[], Any]) -> float:
    """Seconds of one ``fn()`` on this rank, barrier to barrier on ``group`` (every rank calls it together)."""
    group.barrier()
    t0 = time.perf_counter()
    fn()
    group.barrier()
    return time.perf_counter() - t0


def transfer_once(engine: Any, rank: int, tensors: Sequence[tuple[str, Any]], step: int) -> int:
    """One update through ``engine``: rank 0 sends ``tensors`` as ``step``, the others receive (views dropped);
    returns the bytes this rank sent or received."""
    async def go() -> int:
        if rank == 0:
            await engine.send_weights(iter(tensors), step)
            return sum(t.numel() * t.element_size() for _, t in tensors)
        n = nbytes = 0
        async for _name, t in engine.receive_weights(step):
            n += 1
            nbytes += t.numel() * t.element_size()
        if n != len(tensors):
            raise RuntimeError(f"received {n} tensors, sent {len(tensors)}")
        return nbytes
    return asyncio.run(go())
