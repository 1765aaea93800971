"""Resolving the device kind and the per-device calls everyone else makes.

Resolution order: explicit argument > ``HAL_DEVICE`` environment variable > automatic
(npu, cuda, plugin kinds, cpu: the first available). Probes run on first use and are cached; :func:`reset`
clears the cache (tests, or a process that changed its environment).

Function names follow verl's ``verl/utils/device.py`` where it has one, since users port from there.
"""

from __future__ import annotations

import os
import types
from typing import Any, Union

import torch

from devices.base import Availability, DeviceSpec
from hal import registry
from hal.errors import DeviceUnavailableError, UnknownDeviceError

ENV_VAR = "HAL_DEVICE"

DeviceLike = Union[str, torch.device, DeviceSpec, None]

_availability: dict[str, Availability] = {}
_auto_kind: str | None = None


def reset() -> None:
    """Forget cached probe results and the automatic pick (plugins stay registered)."""
    global _auto_kind
    _availability.clear()
    _auto_kind = None


def availability(kind: str) -> Availability:
    """The cached availability of ``kind``; never raises for a known kind.

    Raises:
        UnknownDeviceError: ``kind`` is not a known kind.
    """
    spec = registry.get_spec(kind)
    if spec.kind not in _availability:
        _availability[spec.kind] = spec.availability()
    return _availability[spec.kind]


def available_kinds(probe_all: bool = False) -> list[str]:
    """Every known kind that is usable here, in resolution order.

    Kinds that are never picked automatically (``auto_probe=False``: the simulated npu, whose probe builds
    and registers a torch extension) are probed only with ``probe_all``; otherwise they are listed when an
    earlier call already found them available. Error messages use the cheap form.
    """
    kinds = []
    for kind in registry.known_kinds():
        spec = registry.get_spec(kind)
        if spec.auto_probe or probe_all:
            if availability(kind):
                kinds.append(kind)
        elif kind in _availability and _availability[kind]:
            kinds.append(kind)
    return kinds


def _split_kind(device: str) -> tuple[str, int | None]:
    """``"npu:1"`` -> ``("npu", 1)``; ``"npu-sim"`` -> ``("npu-sim", None)``."""
    kind, sep, index = device.partition(":")
    if not sep:
        return kind.strip().lower(), None
    try:
        return kind.strip().lower(), int(index)
    except ValueError:
        raise UnknownDeviceError(f"device {device!r}: the part after ':' must be an integer index") from None


def _auto() -> DeviceSpec:
    global _auto_kind
    if _auto_kind is None:
        for kind in registry.known_kinds():
            spec = registry.get_spec(kind)
            if spec.auto_probe and availability(kind):
                _auto_kind = kind
                break
        else:  # the cpu kind is always available, so this means the registry is broken
            raise DeviceUnavailableError("no device kind is available, not even cpu")
    return registry.get_spec(_auto_kind)


def resolve_device(device: DeviceLike = None) -> DeviceSpec:
    """The device kind to use: ``device`` if given, else ``$HAL_DEVICE``, else the first available.

    Args:
        device: a kind name (``"npu"``, ``"npu-sim"``), a ``"kind:index"`` string, a ``torch.device``
            (its type is the kind), a spec, or ``None``.

    Raises:
        UnknownDeviceError: the kind is not built in nor registered; the message lists the known kinds.
        DeviceUnavailableError: the kind is known but unusable here; the message gives the probe's reason
            (for npu, the vendor package's import error) and the kinds that are available.
    """
    if isinstance(device, DeviceSpec):
        spec = device
    else:
        if isinstance(device, torch.device):
            kind = device.type
        elif device is None:
            kind = os.environ.get(ENV_VAR, "").strip().lower() or None
            if kind is None:
                return _auto()
        elif isinstance(device, str):
            kind = _split_kind(device)[0]
        else:
            raise UnknownDeviceError(
                f"device must be a kind name, 'kind:index', torch.device or DeviceSpec, got {device!r}")
        spec = registry.get_spec(kind)
    state = availability(spec.kind)
    if not state:
        others = ", ".join(available_kinds()) or "none"
        explicit = [k for k in registry.known_kinds() if k not in _availability and k != spec.kind
                    and not registry.get_spec(k).auto_probe]
        hint = f" (also selectable explicitly, not probed: {', '.join(explicit)})" if explicit else ""
        raise DeviceUnavailableError(
            f"device kind {spec.kind!r} is unavailable: {state.reason}; available kinds: {others}{hint}")
    return spec


def get_device_name(device: DeviceLike = None) -> str:
    """The ``torch.device`` type of the resolved kind: ``"cuda"``, ``"npu"`` or ``"cpu"`` (npu-sim: ``"npu"``)."""
    return resolve_device(device).name


def get_torch_device(device: DeviceLike = None) -> types.ModuleType:
    """The torch module of the resolved kind (the vendor's ``torch.<name>`` module, or a ``torch.cpu`` shim).

    Use the module directly for anything it offers (``Stream``, ``Event``, ``memory_allocated``, ...).
    """
    return resolve_device(device).torch_module()


def get_device_id(device: DeviceLike = None) -> int:
    """The current device index of the resolved kind (0 on cpu)."""
    spec = resolve_device(device)
    if spec.host_memory:
        return 0
    return int(spec.torch_module().current_device())


def get_device(device: DeviceLike = None) -> torch.device:
    """A kind-qualified ``torch.device``: ``cpu``, or ``npu:<index>`` / ``cuda:<index>``.

    An explicit index in ``device`` (``"npu:1"``) is kept; otherwise the kind's current device is used.
    Always qualified by kind, because older Ascend plugin builds sent a bare integer index to CUDA.
    """
    spec = resolve_device(device)
    if spec.host_memory:
        return torch.device("cpu")
    index = _split_kind(device)[1] if isinstance(device, str) else None
    if index is None and isinstance(device, torch.device):
        index = device.index
    return torch.device(spec.name, get_device_id(spec) if index is None else index)


def get_dist_backend(device: DeviceLike = None, with_host: bool = False) -> str:
    """The ``torch.distributed`` backend of the resolved kind: the spec's ``dist_backend`` (NCCL, HCCL or gloo).

    Args:
        with_host: also give gloo for host-side (cpu) tensors and objects, as the pair
            ``"cpu:gloo,<name>:<backend>"`` (plain ``"gloo"`` on the cpu kind).
            Note: torch 2.13 leaves the default backend unset for such a mixed string; prefer passing
            ``device_id`` and a plain name where the caller does not need host-side collectives.
    """
    spec = resolve_device(device)
    if with_host and spec.dist_backend != "gloo":
        return f"cpu:gloo,{spec.name}:{spec.dist_backend}"
    return spec.dist_backend


def get_visible_devices_keyword(device: DeviceLike = None) -> str | None:
    """The visible-devices environment variable of the resolved kind (``None`` on cpu)."""
    return resolve_device(device).visible_devices_env


def synchronize(device: DeviceLike = None) -> None:
    """Block the host until all queued work on the current device of the resolved kind is done."""
    get_torch_device(device).synchronize()


def empty_cache(device: DeviceLike = None) -> None:
    """Return the caching allocator's unused blocks to the device (no-op on cpu)."""
    get_torch_device(device).empty_cache()


def memory_stats(device: DeviceLike = None) -> dict[str, int]:
    """Memory figures of the current device, in bytes.

    Returns:
        ``{"allocated": ..., "max_allocated": ..., "reserved": ..., "free": ..., "total": ...}``; on cpu
        the first three are 0 (nothing is counted) and free/total describe host memory.
    """
    module = get_torch_device(device)
    free, total = module.mem_get_info()
    reserved = getattr(module, "memory_reserved", module.memory_allocated)
    return {
        "allocated": int(module.memory_allocated()),
        "max_allocated": int(module.max_memory_allocated()),
        "reserved": int(reserved()),
        "free": int(free),
        "total": int(total),
    }


def manual_seed(seed: int, device: DeviceLike = None) -> None:
    """Seed torch's host generator and every device generator of the resolved kind.

    Raises:
        ValueError: ``seed`` is not an integer.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    torch.manual_seed(seed)
    get_torch_device(device).manual_seed_all(seed)


def describe(kind: str) -> dict[str, Any]:
    """The facts and availability of one kind, as plain data (used by ``hal info``)."""
    spec = registry.get_spec(kind)
    state = availability(kind)
    return {
        "kind": spec.kind,
        "name": spec.name,
        "dist_backend": spec.dist_backend,
        "visible_devices_env": spec.visible_devices_env,
        "ray_resource": spec.ray_resource,
        "vendor_package": spec.vendor_package,
        "available": state.ok,
        "device_count": state.device_count,
        "reason": state.reason,
    }
