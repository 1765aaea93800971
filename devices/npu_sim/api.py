"""The rest of ``torch.npu`` that verl 0.9.1 and vllm-ascend call, and :func:`build`, which assembles the sim's
``torch.npu``. Each name exists in ``torch_npu.npu`` 2.14.0 and behaves as torch_npu documents it, as far as a
host-memory simulation can: ``get_device_capability`` is ``None`` (as on CANN), ``mstx`` markers and
``ipc_collect`` do nothing, every tensor keeps the plain (ND) layout. Names the sim cannot honour (graphs,
``MemPool``, ``torch_npu.profiler``, ...) stay absent, so ``hasattr`` checks take their fallback.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import sys
import types
from typing import Any


from devices.npu_sim import module
from devices.npu_sim.module import resolve_index

# Keys torch_npu's allocator configuration (PYTORCH_NPU_ALLOC_CONF) accepts; _set_allocator_settings
# takes the same "key:value,key:value" string.
ALLOCATOR_SETTING_KEYS = ("max_split_size_mb", "garbage_collection_threshold", "expandable_segments",
                          "base_addr_aligned_kb", "page_size", "segment_size_mb")

# Ascend 910B-class core counts (torch_npu's NPUDeviceProperties fields); informational only.
CUBE_CORE_NUM = 24
VECTOR_CORE_NUM = 48
L2_CACHE_SIZE = 192 << 20


@dataclasses.dataclass(frozen=True)
class DeviceProperties:
    """What ``torch.npu.get_device_properties`` returns; ``total_memory`` and ``L2_cache_size`` in bytes."""

    name: str
    total_memory: int
    cube_core_num: int = CUBE_CORE_NUM
    vector_core_num: int = VECTOR_CORE_NUM
    L2_cache_size: int = L2_CACHE_SIZE


class Mstx:
    """``torch.npu.mstx``: profiler markers, inert without an attached profiler."""

    _next_id = itertools.count(1)

    @staticmethod
    def mark(message: str = "", stream: Any = None, domain: str = "default") -> None:
        """Record an instant marker (nothing, without a profiler)."""

    @classmethod
    def range_start(cls, message: str = "", stream: Any = None, domain: str = "default") -> int:
        """Open a range; return its id (a positive int) for :meth:`range_end`."""
        return next(cls._next_id)

    @staticmethod
    def range_end(range_id: int, domain: str = "default") -> None:
        """Close the range ``range_id``."""

    @staticmethod
    def mstx_range(message: str = "", stream: Any = None, domain: str = "default"):
        """Decorate a function to run inside a range named ``message``."""
        def wrap(fn):
            @functools.wraps(fn)
            def ranged(*args: Any, **kwargs: Any):
                range_id = Mstx.range_start(message, stream, domain)
                try:
                    return fn(*args, **kwargs)
                finally:
                    Mstx.range_end(range_id, domain)
            return ranged
        return wrap


# Device index -> its total memory in bytes (the capacity before a process fraction applies).
_totals: dict[int, int] = {}
# Device index -> the fraction set by set_per_process_memory_fraction.
_fractions: dict[int, float] = {}
# The allocator settings applied by memory._set_allocator_settings.
_settings: dict[str, str] = {}

# torch.npu.config: the sim keeps every tensor in its plain (ND) layout.
config = types.SimpleNamespace(allow_internal_format=False, jit_compile=False)

mstx = Mstx


def _total(index: int) -> int:
    if index not in _totals:
        _totals[index] = module.extension().capacity(index)
    return _totals[index]


def _apply_limit(index: int) -> None:
    module.extension().set_capacity(index, max(1, int(_total(index) * _fractions.get(index, 1.0))))


def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
    """Limit this process to ``fraction`` (0..1) of the device's total memory; past it allocations raise OOM."""
    if not isinstance(fraction, float):
        raise TypeError(f"Invalid type for fraction argument, must be `float`, got {type(fraction).__name__}")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    index = resolve_index(device)
    _total(index)
    _fractions[index] = fraction
    _apply_limit(index)


def get_per_process_memory_fraction(device: Any = None) -> float:
    """Return the fraction set by :func:`set_per_process_memory_fraction` (1.0 when never set)."""
    return _fractions.get(resolve_index(device), 1.0)


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """Return ``(free, total)`` bytes of the device (``HAL_SIM_NPU_MEMORY``); cached blocks count as used."""
    index = resolve_index(device)
    total = _total(index)
    return max(0, total - module.memory_reserved(index)), total


def set_memory_capacity(nbytes: int, device: Any = None) -> None:
    """Sim only: set the total memory of ``device`` in bytes; allocations past it raise ``torch.OutOfMemoryError``."""
    index = resolve_index(device)
    if int(nbytes) <= 0:
        raise ValueError(f"npu-sim: capacity must be a positive number of bytes, got {nbytes}")
    _totals[index] = int(nbytes)
    _apply_limit(index)


def ipc_collect() -> None:
    """Do nothing: the sim shares no device memory between processes."""


def get_device_capability(device: Any = None) -> None:
    """Return ``None``: CANN has no compute capability (torch_npu returns ``None`` too)."""
    resolve_index(device)
    return None


def get_device_properties(device: Any = None) -> DeviceProperties:
    """Return the name, total memory in bytes and core counts of ``device``."""
    index = resolve_index(device)
    return DeviceProperties(name=module.get_device_name(index), total_memory=_total(index))


def is_current_stream_capturing() -> bool:
    """Return ``False``: the sim never captures graphs."""
    return False


def set_compile_mode(jit_compile: bool = False) -> None:
    """Record the operator compile mode; every sim operator runs eagerly on the host either way."""
    config.jit_compile = bool(jit_compile)


def _set_allocator_settings(value: str) -> None:
    """Validate and record ``"key:value,..."`` allocator settings (PYTORCH_NPU_ALLOC_CONF keys), as torch_npu does.

    The sim's allocator reads none of them; RuntimeError for a malformed entry or unknown key.
    """
    for item in filter(None, (part.strip() for part in str(value).split(","))):
        key, sep, val = item.partition(":")
        if not sep or not val.strip():
            raise RuntimeError(f"npu-sim: allocator setting {item!r} is not 'key:value'")
        if key.strip() not in ALLOCATOR_SETTING_KEYS:
            raise RuntimeError(f"Unrecognized key '{key.strip()}' in NPU caching allocator config; "
                               f"known keys: {', '.join(ALLOCATOR_SETTING_KEYS)}")
        _settings[key.strip()] = val.strip()


def _allocator_settings() -> dict[str, str]:
    """Return the settings applied so far, ``{key: value}``."""
    return dict(_settings)


# The names of torch.npu this module adds to devices.npu_sim.module's.
__all__ = ["set_per_process_memory_fraction", "get_per_process_memory_fraction", "mem_get_info",
           "set_memory_capacity", "ipc_collect", "get_device_capability", "get_device_properties",
           "is_current_stream_capturing", "set_compile_mode", "config", "mstx"]

# The public names of torch.npu.memory (torch_npu/npu/memory.py), all also in torch.npu.
MEMORY_NAMES = ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
                "memory_stats", "reset_peak_memory_stats", "reset_max_memory_allocated", "empty_cache",
                "mem_get_info", "set_per_process_memory_fraction", "get_per_process_memory_fraction")


def build(ext: types.ModuleType) -> types.ModuleType:
    """Return the sim's ``torch.npu`` module over extension ``ext``, with ``memory`` (also in ``sys.modules``)."""
    module.bind(ext)
    npu = types.ModuleType("torch.npu", module.__doc__)
    names = {name: getattr(module, name) for name in module.__all__} | {name: globals()[name] for name in __all__}
    for name, value in names.items():
        setattr(npu, name, value)
    memory = types.ModuleType("torch.npu.memory", "Memory calls of the simulated npu (torch_npu.npu.memory).")
    for name in MEMORY_NAMES:
        setattr(memory, name, names[name])
    memory._set_allocator_settings = _set_allocator_settings
    memory._allocator_settings = _allocator_settings
    npu.memory = memory
    sys.modules["torch.npu.memory"] = memory
    return npu
