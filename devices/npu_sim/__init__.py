"""The npu-sim kind: a simulated Ascend NPU on the host, so the npu code path runs on any machine.

Selected as ``npu-sim``; its tensors are ``npu`` tensors, its backend ``hccl``, its visible-devices variable
``ASCEND_RT_VISIBLE_DEVICES``, and Ray schedules it by its own ``NPU_SIM`` resource. A C++ extension
(``csrc/npu_sim.cpp``, built on first use and cached, :mod:`devices.npu_sim.ext`) registers PrivateUse1 with a
counting allocator, device guard and a fallback running other operators' cpu kernels on the npu bytes, so
byte copies, allocation counts and OOM are real; training matches cpu to about 3e-8. :func:`register` does
what ``import torch_npu`` does (rename to ``npu``, ``torch.npu``, ``hccl``); with ``HAL_DEVICE=npu-sim`` it
runs inside ``import torch`` (:mod:`devices.npu_sim.autoload`).

Environment: ``HAL_SIM_NPU_COUNT`` (default: entries of ``ASCEND_RT_VISIBLE_DEVICES``, else 8),
``HAL_SIM_NPU_MEMORY`` (bytes per device, default 16 GiB), ``HAL_SIM_STRICT=1`` (``torch.cuda`` calls raise),
``HAL_CACHE_DIR`` (build cache), ``HAL_SIM_CACHE_RESIDENT_MB`` (resident free blocks per device, default
1024), ``HAL_SIM_HUGE_PAGES=1`` (2 MiB pages), ``HAL_SIM_POPULATE_THREADS``.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import types

from devices.base import Availability, DeviceSpec

DEFAULT_DEVICE_COUNT = 8
DEFAULT_CAPACITY_BYTES = 16 << 30

_lock = threading.Lock()
_registered: types.ModuleType | None = None


def real_torch_npu_present() -> bool:
    """Return whether a real ``torch_npu`` is importable here (the sim then refuses to register)."""
    from devices.npu_sim import compat

    return compat.real_torch_npu_origin() is not None


def _device_count() -> int:
    raw = os.environ.get("HAL_SIM_NPU_COUNT", "").strip()
    if raw:
        count = int(raw)
    else:
        visible = [v for v in os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "").split(",") if v.strip()]
        count = len(visible) or DEFAULT_DEVICE_COUNT
    if not 1 <= count <= 64:
        raise ValueError(f"HAL_SIM_NPU_COUNT must be in [1, 64], got {count}")
    return count


def capacity_bytes() -> int:
    """Return each simulated device's memory in bytes: ``HAL_SIM_NPU_MEMORY``, default 16 GiB."""
    return int(os.environ.get("HAL_SIM_NPU_MEMORY", DEFAULT_CAPACITY_BYTES))


def register() -> types.ModuleType:
    """Load the extension and register the ``npu`` device, ``torch.npu`` and ``hccl``; idempotent; return ``torch.npu``.

    RuntimeError if a real ``torch_npu`` is importable or PrivateUse1 has another name.
    """
    global _registered
    with _lock:
        if _registered is not None:
            return _registered
        from devices.npu_sim import compat

        if real_torch_npu_present():
            raise RuntimeError(f"a real torch_npu is importable here ({compat.real_torch_npu_origin()}); "
                               "use the 'npu' kind, not 'npu-sim' (both would register the 'npu' device)")
        import torch

        from devices import torch_compat
        from devices.npu_sim import api, backend, strict
        from devices.npu_sim import ext as extension

        current = torch_compat.privateuse1_backend_name()
        if current not in ("privateuseone", "npu"):
            raise RuntimeError(f"PrivateUse1 is already registered as {current!r} in this process; "
                               "the npu-sim kind needs it as 'npu'")
        ext = extension.load()
        ext.init(_device_count())
        capacity = capacity_bytes()
        for index in range(ext.device_count()):
            ext.set_capacity(index, capacity)
        if current != "npu":
            torch.utils.rename_privateuse1_backend("npu")
        if not hasattr(torch, "npu"):
            torch_compat.register_device_module("npu", api.build(ext))
        if not hasattr(torch.Tensor, "is_npu"):
            torch.utils.generate_methods_for_privateuse1_backend(
                for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True)
        backend.register()
        if strict.enabled():
            strict.install()
        compat.install_finder()
        from devices.npu_sim import cann

        try:  # npu-smi and the toolkit's version file, which Ascend tooling (verl's IPC gate) reads
            cann.activate(extension.cache_root(), capacity)
        except OSError:
            pass  # unwritable cache: the versions stay unreadable, which callers take as "no IPC"
        _registered = torch.npu
        return _registered


def _first_error(exc: BaseException) -> str:
    """Return a failure's telling line: a compiler's first ``error:`` line, else the message's first line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if "error:" in line.lower():
            return line
    return lines[0] if lines else ""


@dataclasses.dataclass(frozen=True)
class SimNpuDevice(DeviceSpec):
    """The simulated Ascend kind (see the module doc); pinned host memory works, as on Ascend."""

    kind: str = "npu-sim"
    name: str = "npu"
    dist_backend: str = "hccl"
    visible_devices_env: str | None = "ASCEND_RT_VISIBLE_DEVICES"
    visible_devices_fixed: bool = True  # counted once, by register()
    ray_resource: str | None = "NPU_SIM"  # its own, so simulated workers never take a real Ascend NPU
    auto_probe: bool = False
    supports_pin_memory: bool = True
    # the simulated device memory is host memory: transfer libraries move it in place as host memory
    nixl_memory_type: str | None = "DRAM"
    mooncake_protocol: str | None = "tcp"
    fused_adamw: bool = True  # the fallback runs torch's cpu kernel on the same memory (bit-equal to cpu)
    device_memory_in_host: bool = True

    def host_cached_bytes(self) -> int:
        """Return ``HAL_SIM_CACHE_RESIDENT_MB`` MiB (default 1024), the extension's resident cache limit per device."""
        text = os.environ.get("HAL_SIM_CACHE_RESIDENT_MB", "1024")
        try:
            return max(int(text), 0) << 20
        except ValueError:
            return 0  # strtol reads a non-number as 0: no cached block stays resident

    def host_cache_resident_bytes(self, index: int) -> int:
        """Return what the extension's cache of freed blocks of device ``index`` holds resident, in bytes."""
        return int(self.torch_module().host_cache_stats(index)["resident_bytes"])

    def ipc_transport(self) -> str:
        """Return ``"device"`` where the sim's reported driver and CANN pass verl's gate, else ``"shm"``."""
        from devices import ascend_versions

        register()  # activates its npu-smi and toolkit file (devices.npu_sim.cann), if not yet on PATH
        return "device" if ascend_versions.ipc_supported()[0] else "shm"

    def drop_shared_pages(self, mapping, start: int, nbytes: int) -> bool:
        """Drop pages of a host mapping, or of a sim device buffer opened from a handle (also a host mapping)."""
        from devices.shared_memory import drop_mapped_pages

        return drop_mapped_pages(mapping, start, nbytes)

    def share_device_buffer(self, nbytes: int, device):
        """Return a simulated device buffer over a shared-memory segment."""
        from devices.npu_sim import ipc

        register()
        return ipc.share_buffer(nbytes, device)

    def torch_module(self) -> types.ModuleType:
        """Return the sim's ``torch.npu``, registering it on first use."""
        return register()

    def is_set_up(self) -> bool:
        """Return whether :func:`register` ran in this process."""
        return _registered is not None

    def availability(self, device: int | None = None) -> Availability:
        """Register the sim on first call; unavailable (never raises) if torch_npu is present or the build fails."""
        try:
            module = register()
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return Availability.unavailable(f"npu-sim setup failed: {type(exc).__name__}: {_first_error(exc)}")
        return Availability.available(module.device_count()).of_index(self.kind, device)


SPEC = SimNpuDevice()
