"""The npu kind: Huawei Ascend NPUs through ``torch_npu`` (``torch.npu``), collectives over HCCL.

``torch_npu`` is imported only inside the probes: without CANN its import fails, and it renames PrivateUse1.
"""

from __future__ import annotations

import dataclasses
import types

from devices.base import Availability, DeviceSpec, is_simulation, probe_safely


@dataclasses.dataclass(frozen=True)
class NpuDevice(DeviceSpec):
    kind: str = "npu"
    name: str = "npu"
    dist_backend: str = "hccl"
    visible_devices_env: str | None = "ASCEND_RT_VISIBLE_DEVICES"
    supports_pin_memory: bool = True
    ray_resource: str | None = "NPU"
    vendor_package: str | None = "torch-npu"
    mooncake_protocol: str | None = "ascend_direct"  # NIXL has no Ascend memory type: it stages via DRAM

    def torch_module(self) -> types.ModuleType:
        """Return ``torch.npu`` after ``import torch_npu``; ImportError if that fails or finds hal's npu-sim module."""
        import torch
        import torch_npu

        if is_simulation(torch_npu):
            raise ImportError("torch_npu here is hal's npu-sim compatibility module, not the real package; "
                              "select the 'npu-sim' kind for it")
        return torch.npu

    def ipc_transport(self) -> str:
        """Return ``"device"`` where the driver and CANN allow torch_npu's IPC (verl's gate), else ``"shm"``."""
        from devices import ascend_versions

        return "device" if ascend_versions.ipc_supported()[0] else "shm"

    def share_device_buffer(self, nbytes: int, device):
        """Return an NPU buffer exported with torch's ``reduce_tensor``, which torch_npu extends to npu storages."""
        from devices.ipc import share_with_torch

        return share_with_torch(nbytes, device)

    def availability(self, device: int | None = None) -> Availability:
        """Return whether torch_npu imports and sees an Ascend device (and ``device``, if given, is one of them)."""
        return probe_safely(self.kind, self._probe).of_index(self.kind, device)

    def _probe(self) -> Availability:
        try:
            module = self.torch_module()
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return Availability.unavailable(f"import torch_npu failed: {type(exc).__name__}: {exc}")
        if not module.is_available():
            return Availability.unavailable("torch.npu.is_available() is False (no Ascend device visible)")
        return Availability.available(module.device_count())


SPEC = NpuDevice()
