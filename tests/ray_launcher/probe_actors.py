"""An actor that imports neither torch nor hal, for checks of what Ray alone does (fast to start)."""

from __future__ import annotations

import os

import ray


@ray.remote
class EnvProbe:
    def report(self) -> dict:
        return {"assigned": ray.get_runtime_context().get_assigned_resources(),
                "env": {k: os.environ.get(k) for k in ("ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")}}
