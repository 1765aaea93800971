"""Rollout server adapters for the Ray tests (imported by the Ray workers, so kept free of test fixtures)."""

from __future__ import annotations

import os
import signal

import ckpt


class DiesMidUpdate(ckpt.ModelRolloutAdapter):
    """The served-model adapter, except that receiving step ``at_step`` kills its process after the first tensor."""

    def __init__(self, module, at_step: int, **kwargs) -> None:
        super().__init__(module, **kwargs)
        self.at_step = at_step

    async def update_weights(self, weights, global_steps=None, wire_format="named_tensors", **kwargs):
        if global_steps == self.at_step:
            async for _name, _tensor in weights:
                os.kill(os.getpid(), signal.SIGKILL)  # mid-update: one tensor in, the rest still coming
        return await super().update_weights(weights, global_steps, wire_format, **kwargs)
