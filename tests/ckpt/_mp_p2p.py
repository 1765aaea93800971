"""Process bodies of the transfer-library engine tests (module-level so spawn can import them)."""

from __future__ import annotations

import asyncio
import os
import time

import torch

import ckpt
import hal


def _weights(step: int, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """24 tensors of 1 MiB each (24 MiB), their values naming the step and the tensor."""
    return [(f"w{i}", torch.full((256, 1024), float(step * 100 + i), device=device)) for i in range(24)]


class _DyingAdapter(ckpt.InMemoryRolloutAdapter):
    """Exits the process abruptly after ``after`` tensors of step ``at``."""

    def __init__(self, at: int | None, after: int = 10) -> None:
        super().__init__()
        self.at, self.after = at, after

    async def update_weights(self, weights, global_steps=None, **kwargs):
        if global_steps != self.at:
            return await super().update_weights(weights, global_steps=global_steps, **kwargs)
        count = 0
        async for _ in weights:
            count += 1
            if count == self.after:
                os._exit(0)  # exit code 0: run_multiprocess keeps waiting for the survivors


def death_mid_transfer(rank, world_size, port, engine_name, device, victim, timeout):
    """Step 1 completes; in step 2 rank ``victim`` dies mid-transfer. Each survivor reports
    ``(outcome of step 2, seconds it took, error text, step served, weights served equal step 1's)``."""
    dev = hal.get_device(device)
    engine = ckpt.get_checkpoint_engine(engine_name, rank=rank, world_size=world_size, master_addr="127.0.0.1",
                                        master_port=port, device=device, timeout=timeout, bucket_size=1 << 20)

    async def main():
        if rank == 0:
            await engine.send_weights(iter(_weights(1, dev)), 1)

            def step2():
                for i, item in enumerate(_weights(2, dev)):
                    if victim == 0 and i == 10:
                        os._exit(0)
                    yield item
            start = time.monotonic()
            try:
                await engine.send_weights(step2(), 2)
                return "completed", time.monotonic() - start, "", None, None
            except ckpt.TransferError as exc:
                return type(exc).__name__, time.monotonic() - start, str(exc), None, None
        adapter = _DyingAdapter(2 if rank == victim else None)
        worker = ckpt.CheckpointEngineWorker(engine, adapter)
        await worker.update_weights(1)
        start = time.monotonic()
        try:
            await worker.update_weights(2)
            outcome, text = "completed", ""
        except ckpt.TransferError as exc:
            outcome, text = type(exc).__name__, str(exc)
        served = adapter.state_dict()
        same = all(torch.equal(served[n].cpu(), t.cpu()) for n, t in _weights(1, torch.device("cpu")))
        return outcome, time.monotonic() - start, text, adapter.served_step, same

    try:
        return asyncio.run(main())
    finally:
        engine.close()


def steps_and_version_mismatch(rank, world_size, port, engine_name, device):
    """Steps 1, 2, 3 of :func:`ckpt.testing.sample_weights` from rank 0; the rollouts ask for step 1 when
    step 2 is sent. The trainer reports each send's outcome; a rollout reports per step ``(step, outcome,
    received_global_steps, every tensor byte-exact, device types of what it was handed)``."""
    from ckpt.testing import sample_weights, same_bytes

    engine = ckpt.get_checkpoint_engine(engine_name, rank=rank, world_size=world_size, master_addr="127.0.0.1",
                                        master_port=port, device=device, timeout=30, bucket_size=64 << 10)

    async def main():
        rows = []
        for step, asked in ((1, 1), (2, 1), (3, 3)):
            sent = sample_weights(step)
            if rank == 0:
                await engine.send_weights(iter(sent), step)
                rows.append((step, "sent"))
                continue
            try:
                got = [(n, t.to("cpu", copy=True), t.device.type) async for n, t in engine.receive_weights(asked)]
            except ckpt.VersionMismatchError as exc:
                rows.append((step, str(exc), engine.received_global_steps, None, None))
                continue
            exact = [n for n, _ in sent] == [n for n, _, _ in got] and all(
                same_bytes(a, b) for (_, a), (_, b, _) in zip(sent, got))
            rows.append((step, "ok", engine.received_global_steps, exact, sorted({d for _, _, d in got})))
        return rows

    try:
        return asyncio.run(main())
    finally:
        engine.close()
