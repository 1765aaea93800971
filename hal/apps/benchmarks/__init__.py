"""Benchmarks: each prints ratios measured side by side in one run (the machine is shared and noisy)."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Sequence


def emit(result: dict[str, Any], as_json: bool, print_table: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """The end of a benchmark's ``main``: print ``result`` as indented JSON on stdout when ``as_json``, else
    as ``print_table(result)`` draws it; returns ``result``."""
    if as_json:
        import json

        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    return result


def timed_once(group: Any, fn: Callable[[], Any]) -> float:
    """Seconds of one ``fn()`` on this rank, barrier to barrier on ``group`` (every rank calls it together)."""
    group.barrier()
    t0 = time.perf_counter()
    fn()
    group.barrier()
    return time.perf_counter() - t0


def transfer_once(engine: Any, rank: int, tensors: Sequence[tuple[str, Any]], step: int) -> None:
    """One update through a checkpoint ``engine``: rank 0 sends ``tensors`` (``(name, tensor)`` pairs) tagged
    ``global_steps=step``, every other rank receives it (the yielded views are dropped).

    Raises:
        RuntimeError: a receiver got another number of tensors than ``len(tensors)``.
    """
    async def go() -> None:
        if rank == 0:
            await engine.send_weights(iter(tensors), step)
        else:
            n = 0
            async for _name, _t in engine.receive_weights(step):
                n += 1
            if n != len(tensors):
                raise RuntimeError(f"received {n} tensors, sent {len(tensors)}")
    asyncio.run(go())
