"""The cpu kind: tensors in host memory, collectives over gloo."""

from __future__ import annotations

import dataclasses
import os
import types

from devices.base import Availability, DeviceSpec


def _host_mem_get_info() -> tuple[int, int]:
    """Return (free, total) host memory in bytes."""
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def _make_cpu_module() -> types.ModuleType:
    """Return ``torch.cpu`` completed with the memory and seeding calls hal makes, in their host meaning."""
    import torch

    mod = types.ModuleType("hal_cpu_module", "torch.cpu plus the memory/seed calls hal uses")
    for name in ("is_available", "device_count", "current_device", "set_device", "synchronize",
                 "Stream", "Event", "current_stream", "stream"):
        setattr(mod, name, getattr(torch.cpu, name))
    mod.empty_cache = lambda: None
    mod.memory_allocated = lambda device=None: 0
    mod.max_memory_allocated = lambda device=None: 0
    mod.memory_reserved = lambda device=None: 0
    mod.reset_peak_memory_stats = lambda device=None: None
    mod.memory_stats = lambda device=None: {}
    mod.mem_get_info = lambda device=None: _host_mem_get_info()
    mod.manual_seed = torch.manual_seed
    mod.manual_seed_all = torch.manual_seed
    return mod


_CPU_MODULE: types.ModuleType | None = None


@dataclasses.dataclass(frozen=True)
class CpuDevice(DeviceSpec):
    kind: str = "cpu"
    name: str = "cpu"
    dist_backend: str = "gloo"
    host_memory: bool = True
    fused_adamw: bool = True
    nixl_memory_type: str | None = "DRAM"
    mooncake_protocol: str | None = "tcp"

    def torch_module(self) -> types.ModuleType:
        global _CPU_MODULE
        if _CPU_MODULE is None:
            _CPU_MODULE = _make_cpu_module()
        return _CPU_MODULE

    def availability(self, device: int | None = None) -> Availability:
        """Return availability: always one host device (index 0)."""
        return Availability.available(1).of_index(self.kind, device)


SPEC = CpuDevice()


def is_host(device) -> bool:
    """Return whether ``device`` (a ``torch.device`` or a name such as ``"npu:1"``) is host memory; never raises."""
    return getattr(device, "type", str(device).partition(":")[0]) == SPEC.name
