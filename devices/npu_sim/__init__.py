"""The npu-sim kind: a simulated Ascend NPU on the host, so the npu code path runs on any machine.

Selected as ``npu-sim`` (``HAL_DEVICE=npu-sim``, ``--device npu-sim``); its tensors are ``npu`` tensors,
its backend is ``hccl`` and its visible-devices variable ``ASCEND_RT_VISIBLE_DEVICES``, as on Ascend. Ray
schedules it by a resource of its own, ``NPU_SIM`` (a node declares it with ``--resources``), so that
simulated workers never take a real NPU; ``hal.ray`` gives its actors the per-device
``ASCEND_RT_VISIBLE_DEVICES`` Ray gives ``NPU`` actors.

Route, and why: a small C++ extension (``devices/npu_sim/csrc/npu_sim.cpp``), compiled on first use with
``torch.utils.cpp_extension`` and cached (:mod:`devices.npu_sim.ext`), registers PrivateUse1 with its own
counting allocator, device guard, hooks object (pinned host memory, storage resize, device count) and
factory/copy/view kernels, plus a fallback that runs every other operator's cpu kernel on cpu views of the
npu tensors' own bytes (no host mirror of the inputs, see the C++ source). Like a device, it refuses an
operator whose tensors sit on two device indices (``npu:0`` and ``npu:1``) with torch's "Expected all tensors
to be on the same device" error; copies between devices, and 0-dim cpu scalars, are allowed. PyTorch's experimental
pure-Python PrivateUse1 backend was not used: its empty tensors have no storage of their own, so byte
copies, allocation counts, out-of-memory and ``param.data`` swaps (what offload must prove) could not be
real. Cost of the C++ route: one build of about 25-60 s per source/torch version (cached), and training
that matches cpu to about 3e-8 rather than bit for bit (the optimizer takes other paths off the cpu).

:func:`register` then does what ``import torch_npu`` does, once per process: rename PrivateUse1 to
``npu`` (a second rename raises, so it is guarded), ``torch._register_device_module("npu", ...)``, the
``tensor.npu()`` / ``is_npu`` methods, and the ``hccl`` backend (:mod:`devices.npu_sim.backend`); it adds the
rest of torch_npu's device calls (:mod:`devices.npu_sim.api`) and makes ``import torch_npu`` give the
compatibility module (:mod:`devices.npu_sim.compat`). With ``HAL_DEVICE=npu-sim`` all of this happens inside
``import torch`` (:mod:`devices.npu_sim.autoload`), before any consumer's first import.

Environment: ``HAL_SIM_NPU_COUNT`` (devices, default: entries of ``ASCEND_RT_VISIBLE_DEVICES``, else 8),
``HAL_SIM_NPU_MEMORY`` (capacity per device in bytes, default 16 GiB: the default `hal sync` preset trains with AdamW in fp32, 8 GiB of states plus its step's temporaries), ``HAL_SIM_STRICT=1`` (any
``torch.cuda`` call raises, see :mod:`devices.npu_sim.strict`), ``HAL_CACHE_DIR`` (build cache),
``HAL_SIM_CACHE_RESIDENT_MB`` (host memory the allocator's free blocks may keep resident per device, default
1024 MiB; the least recently freed give their pages back past it: ``torch.npu.host_cache_stats``),
``HAL_SIM_HUGE_PAGES=1`` (back device blocks with 2 MiB transparent huge pages instead of 4 KiB pages: cheaper
to repopulate and give back on a fresh host, slower where the host's memory is fragmented and each fault
compacts it first, so off by default; see ``csrc/npu_sim.cpp``),
``HAL_SIM_POPULATE_THREADS`` (threads that make a large block resident, default: the host's).
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
    """Whether a real ``torch_npu`` is importable here (then the sim refuses to register: both own ``npu``).

    The compatibility module the sim itself provides, an empty ``torch_npu/`` folder or a stray
    ``torch_npu.py`` do not count (see :func:`devices.npu_sim.compat.real_torch_npu_origin`).
    """
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
    """Each simulated device's memory in bytes: ``HAL_SIM_NPU_MEMORY``, default 16 GiB."""
    return int(os.environ.get("HAL_SIM_NPU_MEMORY", DEFAULT_CAPACITY_BYTES))


def register() -> types.ModuleType:
    """Load the extension and register the ``npu`` device, ``torch.npu`` and ``hccl``; idempotent.

    Returns:
        ``torch.npu`` (the sim's module).

    Raises:
        RuntimeError: a real ``torch_npu`` is importable, or PrivateUse1 is already renamed to something
            other than ``npu``; compiler or loader errors of the extension pass through.
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
    """The telling line of a failure: a compiler's first ``error:`` line, else the message's first line."""
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
    # The simulated device memory is host memory (the extension's caching allocator hands out host
    # addresses), so transfer libraries register and move it in place as host memory: NIXL as "DRAM",
    # Mooncake over "tcp". Rollouts then receive into npu tensors, as with VRAM on cuda or ascend_direct on
    # a real npu. Kimi's checkpoint-engine runs (hal's adapter gives its ParameterServer the kind's device
    # facts, so it needs no npu-smi and pulls buckets over "tcp" straight into the simulated device).
    nixl_memory_type: str | None = "DRAM"
    mooncake_protocol: str | None = "tcp"
    fused_adamw: bool = True  # the fallback runs torch's cpu kernel on the same memory (bit-equal to cpu)
    device_memory_in_host: bool = True

    def host_cached_bytes(self) -> int:
        """The extension's limit on resident cached blocks per device: ``HAL_SIM_CACHE_RESIDENT_MB`` MiB
        (default 1024; read as the C++ side reads it: ``csrc/npu_sim.cpp``'s ``cache_resident_limit``)."""
        text = os.environ.get("HAL_SIM_CACHE_RESIDENT_MB", "1024")
        try:
            return max(int(text), 0) << 20
        except ValueError:
            return 0  # strtol reads a non-number as 0: no cached block stays resident

    def host_cache_resident_bytes(self, index: int) -> int:
        """What the extension's cache of freed blocks of device ``index`` holds resident (``torch.npu``'s
        ``host_cache_stats``, sim only)."""
        return int(self.torch_module().host_cache_stats(index)["resident_bytes"])

    def ipc_transport(self) -> str:
        """As on Ascend (:meth:`devices.npu.NpuDevice.ipc_transport`): ``"device"`` where the driver and CANN
        versions the sim reports (:mod:`devices.npu_sim.cann`) pass verl's gate, else ``"shm"``."""
        from devices import ascend_versions

        register()  # activates its npu-smi and toolkit file (devices.npu_sim.cann), if not yet on PATH
        return "device" if ascend_versions.ipc_supported()[0] else "shm"

    def drop_shared_pages(self, mapping, start: int, nbytes: int) -> bool:
        """As for host mappings (:meth:`devices.base.DeviceSpec.drop_shared_pages`), for the sim's opened device
        buffers too: they are segments mapped in host memory (:mod:`devices.npu_sim.ipc`), viewed as npu tensors
        whose pointer is the mapping's."""
        from devices.shared_memory import drop_mapped_pages

        return drop_mapped_pages(mapping, start, nbytes)

    def share_device_buffer(self, nbytes: int, device):
        """A simulated device buffer over a shared-memory segment (:func:`devices.npu_sim.ipc.share_buffer`)."""
        from devices.npu_sim import ipc

        register()
        return ipc.share_buffer(nbytes, device)

    def torch_module(self) -> types.ModuleType:
        """``torch.npu`` of the sim, registering it on first use (see :func:`register` for errors)."""
        return register()

    def is_set_up(self) -> bool:
        """Whether :func:`register` ran in this process (it counted the devices from the variables then)."""
        return _registered is not None

    def availability(self, device: int | None = None) -> Availability:
        """Registers the sim on first call; unavailable (never raises) when torch_npu is present or the build
        fails, or when ``device`` is given and is not one of the simulated devices."""
        try:
            module = register()
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return Availability.unavailable(f"npu-sim setup failed: {type(exc).__name__}: {_first_error(exc)}")
        return Availability.available(module.device_count()).of_index(self.kind, device)


SPEC = SimNpuDevice()
