"""The npu-sim kind: a simulated Ascend NPU on CPU (placeholder until the extension lands)."""

from __future__ import annotations

import dataclasses
import types

from devices.base import Availability, DeviceSpec


@dataclasses.dataclass(frozen=True)
class SimNpuDevice(DeviceSpec):
    kind: str = "npu-sim"
    name: str = "npu"
    dist_backend: str = "hccl"
    visible_devices_env: str | None = "ASCEND_RT_VISIBLE_DEVICES"
    ray_resource: str | None = "NPU"
    auto_probe: bool = False

    def torch_module(self) -> types.ModuleType:
        raise ImportError("the npu-sim kind is not built yet")

    def availability(self) -> Availability:
        return Availability.unavailable("the npu-sim kind is not built yet")


SPEC = SimNpuDevice()
