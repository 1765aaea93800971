"""``torch.npu`` for the simulated Ascend NPU: the calls hal (and FSDP, DDP, autograd) make of a device module.

Names and signatures follow ``torch_npu.npu`` (see ``devices/npu_api_names.txt``, extracted from the
torch-npu wheel), which in turn mirror ``torch.cuda``. Memory figures are the extension's exact counters,
in bytes, of its caching allocator (as torch_npu's): ``memory_allocated()`` counts blocks in use,
``memory_reserved()`` those plus the cached free ones, and ``empty_cache()`` returns the cached ones. Every operator runs synchronously on the host, so streams and
events are correct as no-ops (an event is complete once recorded); only collectives complete later (see
``devices.npu_sim.backend``), and ``synchronize`` runs those queued on the device.
Random numbers come from the host generator (operators fall back to the cpu), so seeding npu seeds it.
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

SIM_EXTRAS = ("is_sim", "set_memory_capacity", "host_cache_stats")
"""Names of the sim's ``torch.npu`` that real ``torch_npu.npu`` lacks: portable code must not use them."""


class InvalidDeviceError(HalError, RuntimeError):
    """A device index outside the simulated devices (``>= device_count()``, or negative where torch_npu
    refuses it); a ``RuntimeError``, as torch_npu's device checks raise. The message names the index and
    the valid range."""


def resolve_index(ext: types.ModuleType, device: DeviceArg, current_if_minus_one: bool = False) -> int:
    """The device index ``device`` names, checked against the devices of ``ext`` as torch_npu checks it.

    ``None`` and an index-less ``"npu"`` / ``torch.device("npu")`` mean the current device; ``3``,
    ``"npu:3"``, ``torch.device("npu", 3)`` mean 3. ``-1`` means the current device only where
    ``current_if_minus_one`` (torch_npu's stream and synchronize calls); any other negative index, and any
    index ``>= device_count()``, is refused (torch_npu's caching allocator: "Invalid device argument").

    Raises:
        InvalidDeviceError: the index is out of range. ValueError: a device of another type (``"cuda:0"``)
            or not a device at all.
    """
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


def build(ext: types.ModuleType) -> types.ModuleType:
    """A fresh module object exposing the sim's device calls, backed by the loaded extension ``ext``.

    Every call that takes a device checks it (:func:`resolve_index`): out of range it raises
    :class:`InvalidDeviceError`, as torch_npu does; ``set_device`` and ``device`` take a negative index as
    "no change", as torch_npu documents.
    """
    mod = types.ModuleType("torch.npu", __doc__)

    def _index(device: DeviceArg = None) -> int:
        return resolve_index(ext, device)

    def _stream_index(device: DeviceArg = None) -> int:
        return resolve_index(ext, device, current_if_minus_one=True)

    def _negative(device: DeviceArg) -> bool:
        return isinstance(device, int) and not isinstance(device, bool) and device < 0

    def is_available() -> bool:
        """Always ``True`` once the sim is registered."""
        return True

    def is_initialized() -> bool:
        return True

    def init() -> None:
        """Nothing to initialise (kept for torch_npu compatibility)."""

    def device_count() -> int:
        """Number of simulated devices (``HAL_SIM_NPU_COUNT``, else the entries of ASCEND_RT_VISIBLE_DEVICES, else 8)."""
        return ext.device_count()

    def current_device() -> int:
        """This thread's current device index."""
        return ext.current_device()

    def set_device(device: DeviceArg) -> None:
        """Make ``device`` this thread's current device; a negative index changes nothing (torch_npu's rule).

        Raises:
            InvalidDeviceError: an index ``>= device_count()``.
        """
        if not _negative(device):
            ext.set_device(_index(device))

    class device:
        """Context manager that makes ``index`` the current device and restores the previous one; a negative
        index (or ``None``) changes nothing, as in torch_npu.

        Raises:
            InvalidDeviceError: an index ``>= device_count()``.
        """

        def __init__(self, index: DeviceArg) -> None:
            self.index = -1 if index is None or _negative(index) else _index(index)
            self.prev = -1

        def __enter__(self) -> None:
            self.prev = ext.current_device()
            if self.index >= 0:
                ext.set_device(self.index)

        def __exit__(self, *exc: Any) -> None:
            ext.set_device(self.prev)

    def synchronize(device: DeviceArg = None) -> None:
        """Block until the device's work is done: run the hccl collectives queued on it (every other operator
        has finished when it returns).

        Raises:
            hal.DistributedTimeoutError: a queued collective did not complete within its group's timeout.
        """
        backend.synchronize(_stream_index(device))

    def empty_cache() -> None:
        """Return the cached (free) blocks of every device to the simulated device: :func:`memory_reserved`
        drops to :func:`memory_allocated`. The device keeps that memory resident (as HBM stays the device's
        after the driver frees it), so a later allocation of a fitting size reuses it without host page
        faults, up to the resident limit of :func:`host_cache_stats`; the host memory itself is given back only
        when the process exits."""
        for index in range(ext.device_count()):
            ext.empty_cache(index)

    def host_cache_stats(device: DeviceArg = None) -> dict[str, int]:
        """Sim only: what the caching allocator of ``device`` keeps in host memory, in bytes.

        Blocks not in use (cached, or released by :func:`empty_cache`) keep at most ``HAL_SIM_CACHE_RESIDENT_MB``
        MiB of host pages (default 1024, per device; read once per process); past it the least recently freed
        ones give their pages back (``madvise(MADV_DONTNEED)``) and stay reserved at the same address, and taking
        one again makes it resident in bulk (see ``cache_resident_limit`` in ``csrc/npu_sim.cpp``).

        Returns:
            ``resident_bytes``: host bytes held now by blocks not in use (at most the limit, plus blocks under
            1 MiB, which are never given back); ``dropped_bytes``: bytes of blocks whose pages were given back,
            summed since the process started; ``repopulated_bytes``: bytes of such blocks made resident again
            when taken back into use, summed likewise (a warm offload round trip of an engine whose blocks fit
            under the limit adds none).
        """
        resident, dropped, repopulated = ext.cache_residency(_index(device))
        return {"resident_bytes": resident, "dropped_bytes": dropped, "repopulated_bytes": repopulated}

    def memory_allocated(device: DeviceArg = None) -> int:
        """Bytes held by live npu storages on ``device``."""
        return ext.memory_allocated(_index(device))

    def max_memory_allocated(device: DeviceArg = None) -> int:
        """Peak of :func:`memory_allocated` since start or :func:`reset_peak_memory_stats`, in bytes."""
        return ext.max_memory_allocated(_index(device))

    def memory_reserved(device: DeviceArg = None) -> int:
        """Bytes the caching allocator holds on ``device``: blocks in use plus cached free blocks."""
        return ext.memory_reserved(_index(device))

    def max_memory_reserved(device: DeviceArg = None) -> int:
        """Peak of :func:`memory_reserved` since start or :func:`reset_peak_memory_stats`, in bytes."""
        return ext.max_memory_reserved(_index(device))

    def reset_peak_memory_stats(device: DeviceArg = None) -> None:
        """Set the allocated and reserved peaks to the current figures."""
        ext.reset_peak_memory_stats(_index(device))

    def mem_get_info(device: DeviceArg = None) -> tuple[int, int]:
        """``(free, total)`` bytes against the simulated capacity (``HAL_SIM_NPU_MEMORY``, default 16 GiB);
        cached blocks count as used, as the driver sees them."""
        index = _index(device)
        total = ext.capacity(index)
        return total - ext.memory_reserved(index), total

    def set_memory_capacity(nbytes: int, device: DeviceArg = None) -> None:
        """Sim only: the capacity of ``device`` in bytes; an allocation past it raises ``torch.OutOfMemoryError``."""
        ext.set_capacity(_index(device), int(nbytes))

    def memory_stats(device: DeviceArg = None) -> dict[str, int]:
        """The torch.cuda-style keys that have a meaning here (bytes and counts)."""
        index = _index(device)
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
        _index(device)
        return DEVICE_NAME

    def get_amp_supported_dtype() -> list[torch.dtype]:
        """Dtypes ``torch.autocast("npu", ...)`` accepts (those of Ascend: float16, bfloat16)."""
        return [torch.float16, torch.bfloat16]

    def is_bf16_supported() -> bool:
        return True

    def manual_seed(seed: int) -> None:
        """Seed the generator npu operators draw from (the host generator, see the module doc)."""
        torch.default_generator.manual_seed(int(seed))  # not torch.manual_seed: that calls back here

    def _is_in_bad_fork() -> bool:
        """Never: the sim has no driver state a fork could corrupt (torch.manual_seed asks)."""
        return False

    def seed() -> None:
        torch.default_generator.seed()

    def get_rng_state(device: DeviceArg = "npu") -> torch.Tensor:
        """The state of the generator npu operators draw from (uint8 tensor on cpu)."""
        return torch.get_rng_state()

    def set_rng_state(new_state: torch.Tensor, device: DeviceArg = "npu") -> None:
        torch.set_rng_state(new_state)

    def initial_seed() -> int:
        return torch.initial_seed()

    class Stream(torch.Stream):
        """An npu stream (``torch.Stream`` on the npu device): work on it is already complete."""

        def __new__(cls, device: DeviceArg = None, priority: int = 0, **kwargs: Any) -> Stream:
            return super().__new__(cls, device=torch.device("npu", _stream_index(device)), priority=priority)

    class Event(torch.Event):
        """An npu event (``torch.Event`` on npu): complete as soon as it is recorded."""

        def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> Event:
            return super().__new__(cls, device=torch.device("npu", ext.current_device()),
                                   enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)

    def current_stream(device: DeviceArg = None) -> torch.Stream:
        return torch.accelerator.current_stream(torch.device("npu", _stream_index(device)))

    def default_stream(device: DeviceArg = None) -> torch.Stream:
        """The stream of id 0 on ``device`` (every stream is equivalent here)."""
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

    for name, value in list(locals().items()):
        if (not name.startswith("_") or name == "_is_in_bad_fork") and name not in ("mod", "ext"):
            setattr(mod, name, value)
    mod.manual_seed_all = manual_seed
    mod.reset_max_memory_allocated = reset_peak_memory_stats
    mod.is_sim = True
    return mod
