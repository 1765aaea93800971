"""Process bodies of the transfer-library engine tests (module-level so spawn can import them)."""

from __future__ import annotations

import asyncio
import os
import time

import torch

import ckpt
import hal
from ckpt.testing import standalone_engine


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


HEARTBEAT_TIMEOUT = 2.0
"""The death tests' ``heartbeat_timeout`` (seconds): a dead rank is found by its heartbeat well before the
engine's ``timeout``, and the tests wait 3 s less than with the default (2 s: four heartbeats, so a rank starved
of CPU on a loaded machine for a moment is not taken for dead)."""


def death_mid_transfer(rank, world_size, engine_name, device, victim, timeout):
    """Step 1 completes; in step 2 rank ``victim`` dies mid-transfer. Each survivor reports
    ``(outcome of step 2, seconds it took, error text, step served, weights served equal step 1's)``."""
    dev = hal.get_device(device)
    engine = standalone_engine(engine_name, rank, world_size, hal.launcher_store(timeout=60), device=device, timeout=timeout, bucket_size=1 << 20,
                                        heartbeat_timeout=HEARTBEAT_TIMEOUT)

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



def steps_mismatch_then_death(rank, world_size, engine_name, device, timeout):
    """Step 1 of :func:`ckpt.testing.sample_weights` from rank 0; step 2 while the rollouts ask for step 1;
    step 3 (:func:`_weights`, 24 tensors) during which rollout rank 2 exits after its third tensor.

    The trainer reports ``[(1, "sent"), (2, "sent"), (3, outcome, seconds, error text)]``; a rollout per step
    ``(step, "ok", received_global_steps, every tensor byte-exact, device types handed over)``, or
    ``(step, error type, received_global_steps, error text)`` (plus the seconds it took, at step 3). Rank 2
    raises, instead of exiting, if its steps 1 and 2 were not exactly the expected ones."""
    from ckpt.testing import sample_weights, same_bytes

    engine = standalone_engine(engine_name, rank, world_size, hal.launcher_store(timeout=60), device=device, timeout=timeout, bucket_size=64 << 10,
                                        heartbeat_timeout=HEARTBEAT_TIMEOUT)

    async def main():
        rows = []
        for step, asked in ((1, 1), (2, 1), (3, 3)):
            expected_rows = [(1, "ok", 1, True, [hal.get_device(device).type]),
                             (2, "VersionMismatchError", 1, f"version mismatch in rollout rank {rank}: asked for "
                              "global_steps=1, but the weights on offer carry global_steps=2")]
            sent = sample_weights(step) if step < 3 else _weights(step, torch.device("cpu"))
            start = time.monotonic()
            if rank == 0:
                try:
                    await engine.send_weights(iter(sent), step)
                    rows.append((step, "sent"))
                except ckpt.TransferError as exc:
                    rows.append((step, type(exc).__name__, time.monotonic() - start, str(exc)))
                continue
            got = []
            try:
                async for n, t in engine.receive_weights(asked):
                    got.append((n, t.to("cpu", copy=True), t.device.type))
                    if step == 3 and rank == 2 and len(got) == 3:
                        if rows != expected_rows:  # what it would have returned: report it instead of dying
                            raise RuntimeError(f"rollout rank 2 before step 3: {rows}")
                        os._exit(0)  # exit code 0: run_multiprocess keeps waiting for the survivors
            except ckpt.CheckpointEngineError as exc:
                rows.append((step, type(exc).__name__, engine.received_global_steps, str(exc))
                            + ((time.monotonic() - start,) if step == 3 else ()))
                continue
            exact = [n for n, _ in sent] == [n for n, _, _ in got] and all(
                same_bytes(a, b) for (_, a), (_, b, _) in zip(sent, got))
            rows.append((step, "ok", engine.received_global_steps, exact, sorted({d for _, _, d in got})))
        return rows

    try:
        return asyncio.run(main())
    finally:
        engine.close()
