"""The transfer-library engines after a failed update that a rollout nonetheless received whole (found by
``hal soak``: a rollout stopped longer than the timeout while every record of the update already waited for it).

The trainer's send fails (no acknowledgement within ``timeout``), it aborts and drops every rollout's connection,
draining their queues. Before the fix the late rollout read the whole update, still queued, kept its connection,
and the next update failed on both sides after ``timeout``: the rollout waited on a queue the trainer no longer
writes, the trainer for a hello. Now the rollout learns that the trainer gave its connection up, does not apply
the update the trainer gave up, connects again, and the next update succeeds."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch

import ckpt
import hal
from ckpt.testing import standalone_engine
from hal.apps.multiprocess import run_multiprocess

pytestmark = pytest.mark.multiprocess
TIMEOUT = 3.0
"""The engines' timeout, seconds."""


def _weights(step: int) -> list[tuple[str, torch.Tensor]]:
    """Two tensors of 64 KiB (one message of the 1 MiB bucket), their values naming the step."""
    return [(f"w{i}", torch.full((16, 1024), float(step * 10 + i))) for i in range(2)]


def late_rollout(rank, world_size, engine_name, flag):
    """Step 1; step 2 with the rollout starting its receive ``TIMEOUT + 0.5`` s late; step 3 once both ended
    their step 2 (as verl's manager starts an update once every call of the last one ended: the rollout says so
    by creating the file ``flag``). Returns per step ``(step, outcome, seconds)``, and on the rollout the step it
    serves with whether its bytes are that step's."""
    engine = standalone_engine(engine_name, rank, world_size, hal.launcher_store(timeout=60), device="cpu", timeout=TIMEOUT, bucket_size=1 << 20)

    async def main():
        rows = []
        adapter = ckpt.InMemoryRolloutAdapter()
        worker = ckpt.CheckpointEngineWorker(engine, adapter) if rank else None
        for step in (1, 2, 3):
            if step == 3 and rank == 0:
                deadline = time.monotonic() + 4 * TIMEOUT
                while not os.path.exists(flag) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
            start = time.monotonic()
            try:
                if rank == 0:
                    await engine.send_weights(iter(_weights(step)), step)
                else:
                    if step == 2:
                        await asyncio.sleep(TIMEOUT + 0.5)  # stopped: the trainer gives the update up meanwhile
                    await worker.update_weights(step)
                outcome = "ok"
            except ckpt.TransferError as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            rows.append((step, outcome, time.monotonic() - start))
            if step == 2 and rank == 1:
                open(flag, "w").close()
                rows.append(adapter.served_step)
        if rank:
            served = adapter.state_dict()
            rows.append((adapter.served_step, all(torch.equal(served[n], t) for n, t in _weights(3))))
        return rows

    try:
        return asyncio.run(main())
    finally:
        engine.close()


@pytest.mark.hal_device("cpu")  # the control connection's logic, the same on every kind
@pytest.mark.parametrize("engine", ["nixl", "mooncake"])
def test_the_update_after_one_the_trainer_gave_up_succeeds(engine, tmp_path):
    ok, reason = ckpt.checkpoint_engine_availability(engine)
    if not ok:
        pytest.skip(f"{engine}: {reason}")
    results = run_multiprocess(late_rollout, 2, engine, str(tmp_path / "rollout-ended-step-2"), timeout=90)
    trainer, rollout = results[0], results[1]
    assert trainer[0][:2] == (1, "ok") and rollout[0][:2] == (1, "ok")
    step, outcome, _ = trainer[1]  # the trainer's send of step 2 failed on the missing acknowledgement
    assert step == 2 and outcome.startswith("TransferTimeoutError") and "rollout rank 1" in outcome, outcome
    step, outcome, _ = rollout[1]  # the late rollout does not apply the step the trainer gave up: it keeps step 1
    assert step == 2 and outcome.startswith("Transfer") and "trainer" in outcome and rollout[2] == 1, rollout
    # step 3 went through on both sides: before the fix both waited out the timeout and failed (no wall-clock
    # bound here: a loaded machine may take longer than TIMEOUT for a good update, and a wait that timed out raises)
    assert trainer[2][:2] == (3, "ok") and rollout[3][:2] == (3, "ok"), (trainer[2], rollout[3])
    assert rollout[4] == (3, True)
