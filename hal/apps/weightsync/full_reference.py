"""The full-publish reference ``hal sync --wire-format delta --compare-full`` measures each delta publish
against: an add-on to the job (a :class:`~hal.apps.weightsync.loop.StepHook`).

The step's published buffer goes out in full through the job's own engine once before the delta publish and
once after the verification; the mean is ``full_publish_s`` and ``delta_vs_full`` is ``publish_s /
full_publish_s``. Rollouts receive into a scratch bank, so the served weights and delta receivers are
untouched.
"""

from __future__ import annotations

import time
from typing import Any

import torch

import hal
from hal.apps.weightsync.loop import attach_everywhere

# engines the reference runs over: its update carries the delta update's step, so a step is taken twice
REFERENCE_FACT = "accepts_repeated_global_steps"


class BankPlacement:
    """A ``ckpt.base.ReceivePlacement`` into ``bank`` laid out by ``layout`` (as the adapter's staging)."""

    def __init__(self, layout: Any, bank: torch.Tensor) -> None:
        self.layout, self.bank = layout, bank

    def target(self, name: str, dtype: torch.dtype, shape: Any) -> torch.Tensor | None:
        entry = self.layout.entries.get(name)
        if entry is None or entry.dtype != dtype or tuple(entry.shape) != tuple(shape):
            return None
        return self.layout.view(self.bank, name)


class FullMember:
    """A worker's side of the full reference (an add-on: see ``Worker.attach``)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    async def publish(self, global_steps: int) -> tuple[float, float]:
        """The trainer sends its published buffer in full; a rollout receives it into a scratch bank. Returns the
        wall-clock start and end of this worker's part."""
        from ckpt.errors import WeightMismatchError

        worker = self.worker
        if worker.index == 0:
            start = time.time()
            await worker.engine.send_weights(worker.published(), global_steps)
            return start, time.time()
        layout = worker.adapter.layout
        bank = layout.allocate(worker.adapter.device)
        placement = BankPlacement(layout, bank)
        start = time.time()
        async for name, tensor in worker.engine.receive_weights(global_steps, placement=placement):
            if name not in layout.entries:
                raise WeightMismatchError(f"full reference: received tensor {name!r} the rollout does not serve")
            dst = layout.view(bank, name)
            if dst.data_ptr() != tensor.data_ptr():
                dst.copy_(tensor)
        hal.synchronize(worker.kind)
        return start, time.time()


class FullReference:
    """The job's hook timing a full publish of each step's weights (UpdateError names a failed worker)."""

    def __init__(self) -> None:
        self.attached: set[int] = set()
        self.samples: dict[int, list[float]] = {}

    async def measure(self, job: Any, global_steps: int) -> float:
        """One full publish of step ``global_steps``'s weights, in seconds."""
        manager = job.manager
        everyone = await attach_everywhere(manager, self.attached, FullMember, "full reference")
        await manager.settle_leftovers()
        try:
            await manager.build_process_group()
            spans = await manager.call(everyone, FullMember.publish, [(global_steps,)] * len(everyone),
                                       what=f"full-publish reference of global_steps {global_steps}")
        finally:
            await manager.finalize([i for i in everyone if i not in manager.unsettled])
        return max(end for _, end in spans[1:]) - max(start for start, _ in spans)

    async def before_publish(self, job: Any, global_steps: int) -> None:
        self.samples[global_steps] = [await self.measure(job, global_steps)]

    async def after_publish(self, job: Any, global_steps: int) -> None:
        self.samples.setdefault(global_steps, []).append(await self.measure(job, global_steps))

    def figures(self, global_steps: int, nbytes: int, publish_s: float) -> dict[str, Any]:
        """``full_publish_s``, ``full_publish_s_each`` and ``delta_vs_full``; step 0: ``full_publish_s`` only."""
        each = self.samples.pop(global_steps, [])
        if not each:
            return {"full_publish_s": None, "delta_vs_full": None}
        full_s = sum(each) / len(each)
        if global_steps == 0:
            return {"full_publish_s": full_s}
        return {"full_publish_s": full_s, "full_publish_s_each": each, "delta_vs_full": publish_s / full_s}

    def members_changed(self, index: int) -> None:
        self.attached.discard(index)


__all__ = ["BankPlacement", "REFERENCE_FACT", "FullMember", "FullReference"]
