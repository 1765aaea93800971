"""Resolve the device kind and make the per-device calls everyone else makes.

Resolution order: explicit argument > ``HAL_DEVICE`` > the first available of npu, cuda, plugin kinds, cpu.
Probes run on first use and are cached; :func:`reset` clears the cache. A call's device is the explicit index
of ``device`` (or of ``$HAL_DEVICE``), else ``$LOCAL_RANK``'s, else the kind's current device; index 0 on
host kinds. Every call that resolves a kind raises UnknownDeviceError (not built in nor registered),
DeviceUnavailableError (known but unusable here) or DeviceIndexError (an index this process has no device
for, or a non-integer ``LOCAL_RANK``). Names follow verl's ``verl/utils/device.py``.
"""

from __future__ import annotations

import dataclasses
import os
import types
from typing import Any

import torch

from devices.base import Availability, DeviceSpec
from hal import registry
from hal.errors import DeviceIndexError, DeviceUnavailableError, HalError, UnknownDeviceError

ENV_VAR = "HAL_DEVICE"

DeviceLike = str | torch.device | DeviceSpec | None

_availability: dict[str, Availability] = {}
_auto_kind: str | None = None


def reset() -> None:
    """Forget cached probe results and the automatic pick (plugins stay registered)."""
    global _auto_kind
    _availability.clear()
    _auto_kind = None


def availability(kind: str) -> Availability:
    """Return the cached availability of ``kind``; raises UnknownDeviceError only for an unknown kind."""
    spec = registry.get_spec(kind)
    if spec.kind not in _availability:
        _availability[spec.kind] = spec.availability()
    return _availability[spec.kind]


def available_kinds(probe_all: bool = False) -> list[str]:
    """Return every known kind that is usable here, in resolution order.

    Kinds with ``auto_probe=False`` (npu-sim) are probed only with ``probe_all``, else listed if already found.
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
    kind, sep, index = device.partition(":")
    if not sep:
        return kind.strip().lower(), None
    try:
        value = int(index)
    except ValueError:
        raise UnknownDeviceError(f"device {device!r}: the part after ':' must be an integer index") from None
    if value < 0:
        raise DeviceIndexError(f"device {device!r}: a device index must be >= 0")
    return kind.strip().lower(), value


def split_device(device: DeviceLike = None) -> tuple[str | DeviceSpec | None, int | None]:
    """Split a device argument into its kind (or spec) and explicit index; ``None`` reads ``$HAL_DEVICE``.

    ``"npu:1"`` and ``torch.device("npu", 1)`` -> ``("npu", 1)``; unset ``HAL_DEVICE`` -> ``(None, None)``.
    """
    if isinstance(device, DeviceSpec):
        return device, None
    if isinstance(device, torch.device):
        return device.type, device.index
    if device is None:
        raw = os.environ.get(ENV_VAR, "").strip()
        if not raw:
            return None, None
        try:
            return _split_kind(raw)
        except HalError as exc:
            raise type(exc)(f"{ENV_VAR}={raw!r}: {exc}") from None
    if isinstance(device, str):
        return _split_kind(device)
    raise UnknownDeviceError(
        f"device must be a kind name, 'kind:index', torch.device or DeviceSpec, got {device!r}")


def _visible_note(spec: DeviceSpec) -> str:
    key = spec.visible_devices_env
    if not key:
        return ""
    value = os.environ.get(key)
    return f" ({key}={value!r})" if value is not None else f" ({key} is unset)"


def check_index(spec: DeviceSpec, index: int, source: str = "the device argument") -> int:
    """Return ``index`` if this process sees a device of that index of ``spec``; host kinds have only 0.

    ``source`` names where the index came from in the DeviceIndexError message (``"LOCAL_RANK=3"``).
    """
    count = 1 if spec.host_memory else availability(spec.kind).device_count
    if not spec.host_memory and count < 1:
        count = int(spec.torch_module().device_count())
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
        raise DeviceIndexError(
            f"device index {index!r} from {source} is out of range: this process sees {count} "
            f"{spec.kind} device(s){_visible_note(spec)}, indices 0..{count - 1}")
    return index


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


def _active_kind_named(name: str) -> DeviceSpec | None:
    """Return the active kind whose tensors have torch device type ``name`` (``npu`` -> npu-sim), or ``None``."""
    try:
        env_kind = split_device(None)[0]
    except HalError:  # a malformed HAL_DEVICE is reported where it is used, not here
        env_kind = None
    candidates = [env_kind] if isinstance(env_kind, str) else []
    candidates += [k for k, state in _availability.items() if state]
    for kind in candidates:
        if kind == name:
            continue
        try:
            spec = registry.get_spec(kind)
        except UnknownDeviceError:
            continue
        if spec.name == name and availability(spec.kind):
            return spec
    return None


def resolve_device(device: DeviceLike = None) -> DeviceSpec:
    """Resolve ``device`` (kind, ``"kind:index"``, ``torch.device``, spec or ``None``) to a device kind.

    A torch device type names the active kind whose tensors have it: with ``HAL_DEVICE=npu-sim``, ``"npu:0"``
    resolves to npu-sim. DeviceUnavailableError gives the probe's reason and the kinds that are available.
    """
    kind, index = split_device(device)
    if kind is None:
        return _auto()
    if isinstance(kind, DeviceSpec):
        spec = kind
    else:
        try:
            spec = registry.get_spec(kind)
        except UnknownDeviceError:
            spec = _active_kind_named(kind)
            if spec is None:
                raise
    state = availability(spec.kind)
    if not state and not isinstance(kind, DeviceSpec):
        alias = _active_kind_named(spec.kind)
        if alias is not None:
            spec, state = alias, availability(alias.kind)
    if not state:
        others = ", ".join(available_kinds()) or "none"
        explicit = [k for k in registry.known_kinds() if k not in _availability and k != spec.kind
                    and not registry.get_spec(k).auto_probe]
        hint = f" (also selectable explicitly, not probed: {', '.join(explicit)})" if explicit else ""
        raise DeviceUnavailableError(
            f"device kind {spec.kind!r} is unavailable: {state.reason}; available kinds: {others}{hint}")
    if index is not None:
        check_index(spec, index, f"{ENV_VAR}={os.environ.get(ENV_VAR)!r}" if device is None else repr(str(device)))
    return spec


def get_device_name(device: DeviceLike = None) -> str:
    """Return the ``torch.device`` type of the resolved kind: ``"cuda"``, ``"npu"`` (also npu-sim) or ``"cpu"``."""
    return resolve_device(device).name


def get_torch_device(device: DeviceLike = None) -> types.ModuleType:
    """Return the torch module of the resolved kind (``torch.<name>``, or a ``torch.cpu`` shim); use it directly."""
    return resolve_device(device).torch_module()


# The variable torch.distributed.run sets to a process's rank on its node.
LOCAL_RANK_VAR = "LOCAL_RANK"


def _local_rank_index(spec: DeviceSpec) -> int | None:
    raw = os.environ.get(LOCAL_RANK_VAR, "").strip()
    if not raw:
        return None
    try:
        index = int(raw)
    except ValueError:
        raise DeviceIndexError(f"{LOCAL_RANK_VAR}={raw!r} is not an integer") from None
    return check_index(spec, index, f"{LOCAL_RANK_VAR}={raw}")


def _spec_and_index(device: DeviceLike) -> tuple[DeviceSpec, int | None]:
    """Return the resolved kind and the checked index of its default device (``None`` on host kinds)."""
    spec = resolve_device(device)
    if spec.host_memory:
        return spec, None
    index = split_device(device)[1]
    return spec, _local_rank_index(spec) if index is None else index


def get_device_id(device: DeviceLike = None) -> int:
    """Return the index of :func:`get_device`'s device; 0 on cpu."""
    spec, index = _spec_and_index(device)
    return _index_or_current(spec, index)


def _index_or_current(spec: DeviceSpec, index: int | None) -> int:
    if spec.host_memory:
        return 0
    return int(spec.torch_module().current_device()) if index is None else index


def get_device(device: DeviceLike = None) -> torch.device:
    """Return this process's device to put tensors on: ``cpu``, or a kind-qualified ``npu:<index>`` / ``cuda:<index>``.

    Reads the environment only; :func:`set_device` makes it current.
    """
    return resolve_local_device(device).device


def set_device(device: DeviceLike = None) -> torch.device:
    """Make :func:`get_device`'s device the current device of its kind (the kind's ``set_device``) and return it."""
    return resolve_local_device(device).bind()  # the kind resolved once, for the device and its module


@dataclasses.dataclass(frozen=True)
class LocalDevice:
    """One process's kind and device, resolved once, so that :meth:`bind` and :meth:`synchronize` probe nothing."""

    spec: DeviceSpec
    device: torch.device

    def __str__(self) -> str:
        """Return the kind with its index (``"npu-sim:1"``; ``"cpu"`` on host kinds), which resolve_device takes."""
        return self.spec.kind if self.spec.host_memory else f"{self.spec.kind}:{self.device.index}"

    def bind(self) -> torch.device:
        """Make :attr:`device` the calling thread's current device (nothing on host kinds) and return it."""
        if not self.spec.host_memory:
            self.spec.torch_module().set_device(self.device.index)
        return self.device

    def synchronize(self) -> None:
        """Block the host until the queued work on :attr:`device` is done (no-op on host kinds)."""
        if not self.spec.host_memory:
            self.spec.torch_module().synchronize(self.device.index)


def resolve_local_device(device: DeviceLike = None) -> LocalDevice:
    """Resolve the kind and :func:`get_device`'s device once, as a :class:`LocalDevice` to keep."""
    spec, index = _spec_and_index(device)  # the kind resolved once, not again through get_device_id
    if spec.host_memory:
        return LocalDevice(spec, torch.device("cpu"))
    return LocalDevice(spec, torch.device(spec.name, _index_or_current(spec, index)))


def get_dist_backend(device: DeviceLike = None, with_host: bool = False) -> str:
    """Return the ``torch.distributed`` backend of the resolved kind (nccl, hccl or gloo).

    ``with_host`` gives ``"cpu:gloo,<name>:<backend>"`` (plain ``"gloo"`` on cpu); torch 2.13 then leaves the
    default backend unset.
    """
    spec = resolve_device(device)
    if with_host and spec.dist_backend != "gloo":
        return f"cpu:gloo,{spec.name}:{spec.dist_backend}"
    return spec.dist_backend


def get_visible_devices_keyword(device: DeviceLike = None) -> str | None:
    """Return the visible-devices environment variable of the resolved kind (``None`` on cpu)."""
    return resolve_device(device).visible_devices_env


def synchronize(device: DeviceLike = None) -> None:
    """Block the host until all queued work on the device is done (no-op on cpu)."""
    spec, index = _spec_and_index(device)
    spec.torch_module().synchronize(index)  # the kind's module: synchronize(device=None)


def empty_cache(device: DeviceLike = None) -> None:
    """Return the caching allocator's unused blocks to the device (no-op on cpu); makes it current meanwhile."""
    spec, index = _spec_and_index(device)
    module = spec.torch_module()
    if index is None:
        module.empty_cache()
        return
    with module.device(index):  # the kind's guard (torch.<name>.device): restores the current device after
        module.empty_cache()


def memory_stats(device: DeviceLike = None) -> dict[str, int]:
    """Return the device's memory figures in bytes: allocated, max_allocated, reserved, free, total.

    On cpu the first three are 0 and free/total describe host memory.
    """
    spec, index = _spec_and_index(device)
    module = spec.torch_module()
    free, total = module.mem_get_info(index)
    reserved = getattr(module, "memory_reserved", module.memory_allocated)
    return {
        "allocated": int(module.memory_allocated(index)),
        "max_allocated": int(module.max_memory_allocated(index)),
        "reserved": int(reserved(index)),
        "free": int(free),
        "total": int(total),
    }


def manual_seed(seed: int, device: DeviceLike = None) -> None:
    """Seed torch's host generator and every device generator of the resolved kind."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    torch.manual_seed(seed)
    get_torch_device(device).manual_seed_all(seed)


def describe(kind: str) -> dict[str, Any]:
    """Return one kind's facts and availability as plain data (``hal info``); probes it once."""
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
        "auto_probe": spec.auto_probe,
    }
