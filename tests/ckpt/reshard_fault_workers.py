"""Rank functions of tests/ckpt/test_reshard_faults.py: the collective engine resharding through verl's
lifecycle, with faults injected per (update, rank)."""

from __future__ import annotations

import asyncio
import time

import torch

import ckpt
import hal
from tests.ckpt.mp_workers import lifecycle
from tests.ckpt.reshard_workers import BUCKET, FlatModule, expected, layout, sender_parts


class _Slow:
    """An adapter that hands the stream on, sleeping ``delay`` seconds before each tensor (a slow consumer)."""

    def __init__(self, adapter, delay: float) -> None:
        self.adapter, self.delay = adapter, delay
        self.receive_placement = getattr(adapter, "receive_placement", None)

    async def update_weights(self, weights, **kwargs):
        async def slow():
            async for item in weights:
                await asyncio.sleep(self.delay)
                yield item
        stream = slow()
        try:
            return await self.adapter.update_weights(stream, **kwargs)
        finally:
            await stream.aclose()


def faulty(rank, world_size, trainers, updates, faults, timeout=8.0, agree=False, engine_name="collective"):
    """``trainers`` senders, the other ranks tensor-parallel ranks of one layout, each through an atomic
    ModelRolloutAdapter (with ``agree``: one server, agreeing over its own gloo group of ``timeout``).
    ``faults``: ``{(update, rank): (kind, value)}`` with kind ``"ask"`` (the rollout asks step ``value``),
    ``"slow"`` (the rollout consumes ``value`` s per tensor), ``"raise"`` (the trainer's iterator raises after
    its first tensor), ``"aclose"`` (the rollout reads one tensor from receive_weights, then aclose()s it).
    Per update: ``error``, ``elapsed`` (s); on a rollout ``served_step`` and ``exact`` (targets equal to the
    served step's slices)."""
    dev = hal.get_device("cpu")
    rollouts = world_size - trainers
    store = hal.launcher_store(timeout=60)
    index = rank - trainers
    lay = layout(index, rollouts) if rank >= trainers else None
    kwargs = {"master_addr": "127.0.0.1"} if engine_name == "collective" else {}
    engine = ckpt.get_checkpoint_engine(engine_name, is_master=rank == 0, device="cpu", timeout=timeout,
                                        bucket_size=BUCKET, multi_sender=True, rollout_layout=lay, **kwargs)
    model = None
    if rank >= trainers:
        agreement = {}
        if agree:
            import torch.distributed as dist

            from hal.apps.weightsync.tp import agreement as tp_agreement

            hal.init_process_group("cpu", store=dist.PrefixStore("tp", store), rank=index, world_size=rollouts,
                                   timeout=timeout)
            agreement = {"agree": tp_agreement(dev)}
        model = ckpt.ModelRolloutAdapter(FlatModule(expected(0, lay)), atomic=True, **agreement)
    reports = []
    for update in range(1, updates + 1):
        kind, value = faults.get((update, rank), (None, None))
        lifecycle(engine, store, f"u{update}", rank, trainers, rollouts)
        error, start = None, time.monotonic()
        try:
            if rank < trainers:
                parts = sender_parts(update, rank, trainers, dev)
                if kind == "raise":
                    def broken(parts=parts):
                        yield parts[0]
                        raise RuntimeError("the trainer's weights iterator broke")
                    asyncio.run(engine.send_weights(broken(), update))
                else:
                    asyncio.run(engine.send_weights(parts, update))
            elif kind == "aclose":
                async def early(update=update):
                    stream = engine.receive_weights(update)
                    async for _ in stream:
                        break
                    await stream.aclose()
                    return time.monotonic()
                closed_at = asyncio.run(early())
                error = f"aclosed after {closed_at - start:.1f}s"
            else:
                adapter = model if kind != "slow" else _Slow(model, value)
                asked = value if kind == "ask" else update
                asyncio.run(ckpt.CheckpointEngineWorker(engine, adapter).update_weights(asked))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            error = f"{type(exc).__name__}: {exc}"
        report = {"update": update, "error": error, "elapsed": time.monotonic() - start}
        if model is not None:
            step = model.served_step
            served = dict(model.module.named_buffers())
            want = expected(step or 0, lay)
            report.update(served_step=step, exact=sum(torch.equal(served[n], t) for n, t in want.items()))
        engine.finalize()
        reports.append(report)
        store.set(f"done/{update}/{rank}", b"1")
        store.wait([f"done/{update}/{r}" for r in range(world_size)])
    engine.close()
    store.set(f"left/{rank}", b"1")
    if rank == 0:
        store.wait([f"left/{r}" for r in range(world_size)])
    return reports
