"""``torch.npu`` for the simulated Ascend NPU: the calls hal (and FSDP, DDP, autograd) make of a device module.

Names and signatures follow ``torch_npu.npu`` (``devices/npu_api_names.txt``). Memory figures are the
extension's exact caching-allocator counters, in bytes. Operators run synchronously on the host, so streams
and events are no-ops; only collectives complete later, and ``synchronize`` runs those queued on the device.
Random numbers come from the host generator. :func:`bind` hands the calls the loaded extension;
:func:`devices.npu_sim.api.build` gathers them into the module registered as ``torch.npu``.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import torch

from devices.errors import HalError
from devices.npu_sim import backend

DeviceArg = int | str | torch.device | None

DEVICE_NAME = "Ascend-sim (npu-sim on host memory)"

# Names of the sim's torch.npu that real torch_npu.npu lacks: portable code must not use them.
SIM_EXTRAS = ("is_sim", "set_memory_capacity", "host_cache_stats")

# The loaded extension (csrc/npu_sim.cpp) behind every call; set once by bind().
_ext: types.ModuleType | None = None


def bind(ext: types.ModuleType) -> None:
    """Back this module's calls by the loaded extension ``ext`` (:func:`devices.npu_sim.register` does, once)."""
    global _ext
    _ext = ext


def extension() -> types.ModuleType:
    """Return the extension bound by :func:`bind`; RuntimeError when the sim is not registered here."""
    if _ext is None:
        raise RuntimeError("npu-sim: torch.npu called before the sim was registered (devices.npu_sim.register)")
    return _ext


class InvalidDeviceError(HalError, RuntimeError):
    """A device index outside the simulated devices; a ``RuntimeError``, as torch_npu's device checks raise."""


def resolve_index(device: DeviceArg, current_if_minus_one: bool = False) -> int:
    """Return the device index ``device`` names, checked against the simulated devices as torch_npu does.

    ``None`` and index-less ``"npu"`` mean the current device; ``-1`` too only where ``current_if_minus_one``.
    InvalidDeviceError for other negative or too large indices; ValueError for another device type.
    """
    ext = extension()
    if device is None:
        return ext.current_device()
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "npu":
            raise ValueError(f"expected an npu device, got {device}")
        if device.index is None:
            return ext.current_device()
        device = device.index
    if not isinstance(device, int) or isinstance(device, bool):
        raise ValueError(f"device must be an int, 'npu:<index>' or torch.device, got {device!r}")
    if device == -1 and current_if_minus_one:
        return ext.current_device()
    count = ext.device_count()
    if not 0 <= device < count:
        raise InvalidDeviceError(f"Invalid device argument {device}: npu-sim has {count} devices in this process "
                                 f"(valid indices 0..{count - 1}; HAL_SIM_NPU_COUNT / ASCEND_RT_VISIBLE_DEVICES)")
    return device


def _negative(device: DeviceArg) -> bool:
    return isinstance(device, int) and not isinstance(device, bool) and device < 0


def is_available() -> bool:
    """Return ``True`` (the sim is registered)."""
    return True


def is_initialized() -> bool:
    return True


def init() -> None:
    """Do nothing (kept for torch_npu compatibility)."""


def device_count() -> int:
    """Return the number of simulated devices (``HAL_SIM_NPU_COUNT``, else ASCEND_RT_VISIBLE_DEVICES's, else 8)."""
    return extension().device_count()


def current_device() -> int:
    """Return this thread's current device index."""
    return extension().current_device()


def set_device(device: DeviceArg) -> None:
    """Make ``device`` this thread's current device; a negative index changes nothing (torch_npu's rule)."""
    if not _negative(device):
        extension().set_device(resolve_index(device))


class device:
    """Context manager making ``index`` the current device; a negative index or ``None`` changes nothing."""

    def __init__(self, index: DeviceArg) -> None:
        self.index = -1 if index is None or _negative(index) else resolve_index(index)
        self.prev = -1

    def __enter__(self) -> None:
        self.prev = extension().current_device()
        if self.index >= 0:
            extension().set_device(self.index)

    def __exit__(self, *exc: Any) -> None:
        extension().set_device(self.prev)


def synchronize(device: DeviceArg = None) -> None:
    """Block until the device's work is done: run the hccl collectives queued on it."""
    backend.synchronize(resolve_index(device, current_if_minus_one=True))


def empty_cache() -> None:
    """Return the cached free blocks of every device: :func:`memory_reserved` drops to :func:`memory_allocated`.

    The pages stay resident (up to :func:`host_cache_stats`' limit) for reuse until the process exits.
    """
    ext = extension()
    for index in range(ext.device_count()):
        ext.empty_cache(index)


def host_cache_stats(device: DeviceArg = None) -> dict[str, int]:
    """Sim only: return what the caching allocator of ``device`` keeps in host memory, in bytes.

    ``resident_bytes``: held now by unused blocks (at most ``HAL_SIM_CACHE_RESIDENT_MB`` MiB per device, default
    1024, plus blocks under 1 MiB); ``dropped_bytes`` / ``repopulated_bytes``: bytes given back / made resident
    again since the process started.
    """
    resident, dropped, repopulated = extension().cache_residency(resolve_index(device))
    return {"resident_bytes": resident, "dropped_bytes": dropped, "repopulated_bytes": repopulated}


def memory_allocated(device: DeviceArg = None) -> int:
    """Return the bytes held by live npu storages on ``device``."""
    return extension().memory_allocated(resolve_index(device))


def max_memory_allocated(device: DeviceArg = None) -> int:
    """Return the peak of :func:`memory_allocated` since start or :func:`reset_peak_memory_stats`, in bytes."""
    return extension().max_memory_allocated(resolve_index(device))


def memory_reserved(device: DeviceArg = None) -> int:
    """Return the bytes the caching allocator holds on ``device`` (in use plus cached)."""
    return extension().memory_reserved(resolve_index(device))


def max_memory_reserved(device: DeviceArg = None) -> int:
    """Return the peak of :func:`memory_reserved` since start or :func:`reset_peak_memory_stats`, in bytes."""
    return extension().max_memory_reserved(resolve_index(device))


def reset_peak_memory_stats(device: DeviceArg = None) -> None:
    """Set the allocated and reserved peaks to the current figures."""
    extension().reset_peak_memory_stats(resolve_index(device))


reset_max_memory_allocated = reset_peak_memory_stats


def memory_stats(device: DeviceArg = None) -> dict[str, int]:
    """Return the torch.cuda-style keys that have a meaning here (bytes and counts)."""
    ext, index = extension(), resolve_index(device)
    allocs, frees = ext.alloc_counts(index)
    segments, released, retries, ooms = ext.segment_counts(index)
    current, peak = ext.memory_allocated(index), ext.max_memory_allocated(index)
    return {"allocated_bytes.all.current": current, "allocated_bytes.all.peak": peak,
            "reserved_bytes.all.current": ext.memory_reserved(index),
            "reserved_bytes.all.peak": ext.max_memory_reserved(index),
            "active_bytes.all.current": current, "num_alloc_retries": retries, "num_ooms": ooms,
            "allocation.all.allocated": allocs, "allocation.all.freed": frees,
            "segment.all.allocated": segments, "segment.all.freed": released}


def get_device_name(device: DeviceArg = None) -> str:
    resolve_index(device)
    return DEVICE_NAME


def get_amp_supported_dtype() -> list[torch.dtype]:
    """Return the dtypes ``torch.autocast("npu", ...)`` accepts (float16, bfloat16)."""
    return [torch.float16, torch.bfloat16]


def is_bf16_supported() -> bool:
    return True


def manual_seed(seed: int) -> None:
    """Seed the generator npu operators draw from (the host generator)."""
    torch.default_generator.manual_seed(int(seed))  # not torch.manual_seed: that calls back here


manual_seed_all = manual_seed


def _is_in_bad_fork() -> bool:
    """Return ``False``: the sim has no driver state a fork could corrupt."""
    return False


def seed() -> None:
    torch.default_generator.seed()


def get_rng_state(device: DeviceArg = "npu") -> torch.Tensor:
    """Return the state of the generator npu operators draw from (uint8 tensor on cpu)."""
    return torch.get_rng_state()


def set_rng_state(new_state: torch.Tensor, device: DeviceArg = "npu") -> None:
    torch.set_rng_state(new_state)


def initial_seed() -> int:
    return torch.initial_seed()


class Stream(torch.Stream):
    """An npu stream (``torch.Stream`` on the npu device): work on it is already complete."""

    def __new__(cls, device: DeviceArg = None, priority: int = 0, **kwargs: Any) -> Stream:
        index = resolve_index(device, current_if_minus_one=True)
        return super().__new__(cls, device=torch.device("npu", index), priority=priority)


class Event(torch.Event):
    """An npu event (``torch.Event`` on npu): complete as soon as it is recorded."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> Event:
        return super().__new__(cls, device=torch.device("npu", extension().current_device()),
                               enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)


def current_stream(device: DeviceArg = None) -> torch.Stream:
    return torch.accelerator.current_stream(torch.device("npu", resolve_index(device, current_if_minus_one=True)))


def default_stream(device: DeviceArg = None) -> torch.Stream:
    """Return the stream of id 0 on ``device`` (every stream is equivalent here)."""
    return current_stream(device)


def set_stream(stream: torch.Stream) -> None:
    torch.accelerator.set_stream(stream)


@contextlib.contextmanager
def stream(stream: torch.Stream | None):
    """Make ``stream`` current inside the block (``None``: no change)."""
    if stream is None:
        yield
        return
    prev = current_stream(stream.device)
    torch.accelerator.set_stream(stream)
    try:
        yield
    finally:
        torch.accelerator.set_stream(prev)


is_sim = True

# The names of torch.npu this module gives (_is_in_bad_fork: torch.manual_seed asks); api.py adds the rest.
__all__ = [
    "is_available", "is_initialized", "init", "device_count", "current_device", "set_device", "device",
    "synchronize", "empty_cache", "host_cache_stats", "memory_allocated", "max_memory_allocated",
    "memory_reserved", "max_memory_reserved", "reset_peak_memory_stats", "reset_max_memory_allocated",
    "memory_stats", "get_device_name", "get_amp_supported_dtype", "is_bf16_supported", "manual_seed",
    "manual_seed_all", "_is_in_bad_fork", "seed", "get_rng_state", "set_rng_state", "initial_seed", "Stream",
    "Event", "current_stream", "default_stream", "set_stream", "stream", "is_sim",
]
