"""Resolving the device kind and the per-device calls everyone else makes.

Resolution order: explicit argument > ``HAL_DEVICE`` environment variable > automatic
(npu, cuda, plugin kinds, cpu: the first available). Probes run on first use and are cached; :func:`reset`
clears the cache (tests, or a process that changed its environment).

Function names follow verl's ``verl/utils/device.py`` where it has one, since users port from there.
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
        value = int(index)
    except ValueError:
        raise UnknownDeviceError(f"device {device!r}: the part after ':' must be an integer index") from None
    if value < 0:
        raise DeviceIndexError(f"device {device!r}: a device index must be >= 0")
    return kind.strip().lower(), value


def split_device(device: DeviceLike = None) -> tuple[str | DeviceSpec | None, int | None]:
    """The kind and the explicit device index of a device argument, the one parser every entry point uses.

    ``"npu:1"`` -> ``("npu", 1)``; ``torch.device("npu", 1)`` -> ``("npu", 1)``; ``"npu-sim"`` ->
    ``("npu-sim", None)``; a spec -> ``(spec, None)``; ``None`` -> the same for ``$HAL_DEVICE``, or
    ``(None, None)`` when it is unset (automatic choice).

    Raises:
        UnknownDeviceError: not a device argument, or the part after ``':'`` is not an integer.
        DeviceIndexError: a negative index.
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
    """``index`` if this process sees a device of that index of kind ``spec``; host kinds have one, index 0.

    Args:
        source: where the index came from, for the message (``"HAL_DEVICE='npu:3'"``, ``"LOCAL_RANK=3"``).

    Raises:
        DeviceIndexError: ``index`` is negative or not below the kind's device count; the message names the
            index, its source, the count and the visible-devices variable with its value.
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
    """The active kind whose tensors have torch device type ``name`` under another kind name, or ``None``.

    Active: the kind ``$HAL_DEVICE`` names (probed if it was not yet), else a kind an earlier call already
    found available. This is how ``tensor.device`` of an npu-sim tensor (``npu:0``) resolves to npu-sim,
    while an unavailable kind no active kind stands for (``cuda`` there) still fails.
    """
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
    """The device kind to use: ``device`` if given, else ``$HAL_DEVICE``, else the first available.

    Args:
        device: a kind name (``"npu"``, ``"npu-sim"``), a ``"kind:index"`` string, a ``torch.device``
            (its type is the kind), a spec, or ``None``. ``$HAL_DEVICE`` takes the same strings.
            An index is checked here (see :func:`check_index`) and honoured by :func:`get_device`,
            :func:`local_device` and the per-device calls (:func:`synchronize`, :func:`memory_stats`, ...).
            A torch device type that is not itself a usable kind names the active kind whose tensors have
            that type: with ``HAL_DEVICE=npu-sim``, ``"npu"``, ``"npu:0"`` and ``torch.device("npu", 0)``
            (``tensor.device`` of its tensors) resolve to ``npu-sim``, as they resolve to ``npu`` on Ascend.

    Raises:
        DeviceIndexError: an index this process has no device for.
        UnknownDeviceError: the kind is not built in nor registered; the message lists the known kinds.
        DeviceUnavailableError: the kind is known but unusable here; the message gives the probe's reason
            (for npu, the vendor package's import error) and the kinds that are available.
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
    """The ``torch.device`` type of the resolved kind: ``"cuda"``, ``"npu"`` or ``"cpu"`` (npu-sim: ``"npu"``).

    Raises:
        UnknownDeviceError: the kind is not built in nor registered.
        DeviceUnavailableError: the kind is known but unusable here.
        DeviceIndexError: an explicit index this process has no device for.
    """
    return resolve_device(device).name


def get_torch_device(device: DeviceLike = None) -> types.ModuleType:
    """The torch module of the resolved kind (the vendor's ``torch.<name>`` module, or a ``torch.cpu`` shim).

    Use the module directly for anything it offers (``Stream``, ``Event``, ``memory_allocated``, ...).

    Raises:
        UnknownDeviceError: the kind is not built in nor registered.
        DeviceUnavailableError: the kind is known but unusable here.
        DeviceIndexError: an explicit index this process has no device for.
    """
    return resolve_device(device).torch_module()


LOCAL_RANK_VAR = "LOCAL_RANK"
"""The variable ``torch.distributed.run`` sets to a process's rank on its node."""


def _local_rank_index(spec: DeviceSpec) -> int | None:
    """``$LOCAL_RANK`` as a checked device index of ``spec``, or ``None`` when it is unset or empty.

    Raises:
        DeviceIndexError: not an integer, or not below the number of ``spec`` devices this process sees.
    """
    raw = os.environ.get(LOCAL_RANK_VAR, "").strip()
    if not raw:
        return None
    try:
        index = int(raw)
    except ValueError:
        raise DeviceIndexError(f"{LOCAL_RANK_VAR}={raw!r} is not an integer") from None
    return check_index(spec, index, f"{LOCAL_RANK_VAR}={raw}")


def _spec_and_index(device: DeviceLike) -> tuple[DeviceSpec, int | None]:
    """The resolved kind and the checked index of its default device, the one rule every call without an
    index follows: the explicit index of ``device`` (or of ``$HAL_DEVICE``), else ``$LOCAL_RANK``'s, else
    ``None`` (the kind's current device); ``None`` for host kinds."""
    spec = resolve_device(device)
    if spec.host_memory:
        return spec, None
    index = split_device(device)[1]
    return spec, _local_rank_index(spec) if index is None else index


def get_device_id(device: DeviceLike = None) -> int:
    """The index of the device ``device`` names, that of :func:`get_device`: its explicit index
    (``"npu-sim:1"`` -> 1, or that of ``$HAL_DEVICE`` when ``device`` is ``None``), else ``$LOCAL_RANK`` (a
    launched rank's own device), else the current device index of the resolved kind; 0 on cpu.

    Raises:
        UnknownDeviceError: the kind is not built in nor registered.
        DeviceUnavailableError: the kind is known but unusable here.
        DeviceIndexError: the index (explicit or ``LOCAL_RANK``) is not below the number of devices this
            process sees, or ``LOCAL_RANK`` is not an integer.
    """
    spec, index = _spec_and_index(device)
    return _index_or_current(spec, index)


def _index_or_current(spec: DeviceSpec, index: int | None) -> int:
    """``index``, else the kind's current device index; 0 for host kinds."""
    if spec.host_memory:
        return 0
    return int(spec.torch_module().current_device()) if index is None else index


def get_device(device: DeviceLike = None) -> torch.device:
    """The device to put tensors on: ``cpu``, or a kind-qualified ``npu:<index>`` / ``cuda:<index>``.

    The index: the explicit index of ``device`` (``"npu:1"``, or ``HAL_DEVICE=npu:1`` when ``device`` is
    ``None``); else ``$LOCAL_RANK``, so that a rank started by ``hal launch`` or ``torch.distributed.run``
    gets its own device without binding anything first (the device :func:`local_device` names and engines
    put their model on); else the kind's current device (``set_device``). Always qualified by kind, because
    older Ascend plugin builds sent a bare integer index to CUDA. A launched rank that means to use another
    device than its local rank's says so with an index (``"npu:3"``, ``HAL_DEVICE=npu:3``). This reads the
    environment only; it makes no device current (see :func:`bind_local_device` for that).

    Raises:
        DeviceIndexError: the index (explicit or ``LOCAL_RANK``) is out of range (see :func:`check_index`),
            or ``LOCAL_RANK`` is not an integer.
        UnknownDeviceError: the kind is not built in nor registered.
        DeviceUnavailableError: the kind is known but unusable here.
    """
    return resolve_local_device(device).device


def local_device(device: DeviceLike = None) -> torch.device:
    """The device this process's rank should use: the explicit index of ``device`` (or ``$HAL_DEVICE``),
    else ``$LOCAL_RANK`` (one device per local rank, as ``torch.distributed.run`` numbers them), else the
    kind's current device; ``cpu`` for host kinds. The same device as :func:`get_device`, which follows
    this one rule too; :func:`bind_local_device` makes it current.

    Raises:
        DeviceIndexError: the index (explicit or ``LOCAL_RANK``) is not below the number of devices this
            process sees; the message names the variable and the visible-devices variable with its value.
        UnknownDeviceError: the kind is not built in nor registered.
        DeviceUnavailableError: the kind is known but unusable here.
    """
    return get_device(device)


def bind_local_device(device: DeviceLike = None) -> torch.device:
    """Make :func:`local_device` the current device of the resolved kind (``set_device``); returns it.

    Every process hal starts and every checkpoint engine calls this before allocating, so that ranks of one
    node never share a device (a communicator refuses that, as NCCL does). A launched rank needs it only for
    code that takes the current device implicitly (``torch.ones(3, device="npu")``, the kind module's
    ``current_device()``, collectives): :func:`get_device`, :func:`local_device` and engines already name
    the local rank's device without it.

    Raises:
        DeviceIndexError: see :func:`local_device`.
        UnknownDeviceError: the kind is not built in nor registered.
        DeviceUnavailableError: the kind is known but unusable here.
    """
    return resolve_local_device(device).bind()  # the kind resolved once, for the device and its module


@dataclasses.dataclass(frozen=True)
class LocalDevice:
    """One process's device of a resolved kind, resolved once (:func:`resolve_local_device`): what a checkpoint
    engine or a training engine keeps instead of a kind name, so that the calls it makes on every update
    (:meth:`bind` in each worker thread, :meth:`synchronize`) look nothing up in the registry and probe
    nothing; passing ``"npu-sim:1"`` to :func:`bind_local_device` resolves it again on every call.

    Attributes:
        spec: the resolved kind.
        device: its ``torch.device`` (``cpu`` for host kinds, else kind-qualified with an index).
    """

    spec: DeviceSpec
    device: torch.device

    def __str__(self) -> str:
        """The kind with the index (``"npu-sim:1"``), a host kind as its name (``"cpu"``): a string
        :func:`resolve_device` takes back."""
        return self.spec.kind if self.spec.host_memory else f"{self.spec.kind}:{self.device.index}"

    def bind(self) -> torch.device:
        """Make :attr:`device` the current device of the calling thread (``set_device``; nothing on host kinds),
        as :func:`bind_local_device` does; returns it."""
        if not self.spec.host_memory:
            self.spec.torch_module().set_device(self.device.index)
        return self.device

    def synchronize(self) -> None:
        """Block the host until the queued work on :attr:`device` is done (no-op on host kinds), as
        :func:`synchronize` does."""
        if not self.spec.host_memory:
            self.spec.torch_module().synchronize(self.device.index)


def resolve_local_device(device: DeviceLike = None) -> LocalDevice:
    """The resolved kind and the device :func:`local_device` names (the explicit index of ``device``, else
    ``$LOCAL_RANK``'s, else the kind's current device), once, as a :class:`LocalDevice` to keep.

    Raises:
        UnknownDeviceError, DeviceUnavailableError, DeviceIndexError: as :func:`local_device`.
    """
    spec, index = _spec_and_index(device)  # the kind resolved once, not again through get_device_id
    if spec.host_memory:
        return LocalDevice(spec, torch.device("cpu"))
    return LocalDevice(spec, torch.device(spec.name, _index_or_current(spec, index)))


def get_dist_backend(device: DeviceLike = None, with_host: bool = False) -> str:
    """The ``torch.distributed`` backend of the resolved kind: the spec's ``dist_backend`` (NCCL, HCCL or gloo).

    Args:
        with_host: also give gloo for host-side (cpu) tensors and objects, as the pair
            ``"cpu:gloo,<name>:<backend>"`` (plain ``"gloo"`` on the cpu kind).
            Note: torch 2.13 leaves the default backend unset for such a mixed string; prefer passing
            ``device_id`` and a plain name where the caller does not need host-side collectives.

    Raises:
        UnknownDeviceError: the kind is not built in nor registered.
        DeviceUnavailableError: the kind is known but unusable here.
        DeviceIndexError: an explicit index this process has no device for.
    """
    spec = resolve_device(device)
    if with_host and spec.dist_backend != "gloo":
        return f"cpu:gloo,{spec.name}:{spec.dist_backend}"
    return spec.dist_backend


def get_visible_devices_keyword(device: DeviceLike = None) -> str | None:
    """The visible-devices environment variable of the resolved kind (``None`` on cpu).

    Raises:
        UnknownDeviceError: the kind is not built in nor registered.
        DeviceUnavailableError: the kind is known but unusable here.
        DeviceIndexError: an explicit index this process has no device for.
    """
    return resolve_device(device).visible_devices_env


def synchronize(device: DeviceLike = None) -> None:
    """Block the host until all queued work on one device of the resolved kind is done (no-op on cpu).

    The device is that of :func:`get_device`: the explicit index of ``device`` (``"npu-sim:1"``,
    ``torch.device("npu", 1)``, or ``$HAL_DEVICE``'s index when ``device`` is ``None``), else
    ``$LOCAL_RANK``'s, else the current device of the resolved kind (``set_device``; see
    :func:`bind_local_device`). Indices count the devices this process sees (after the visible-devices
    variable), as torch's do.

    Raises:
        UnknownDeviceError: the kind is not built in nor registered.
        DeviceUnavailableError: the kind is known but unusable here.
        DeviceIndexError: the index (explicit or ``LOCAL_RANK``) is not below the number of devices this
            process sees, or ``LOCAL_RANK`` is not an integer.
    """
    spec, index = _spec_and_index(device)
    spec.torch_module().synchronize(index)  # the kind's module: synchronize(device=None)


def empty_cache(device: DeviceLike = None) -> None:
    """Return the caching allocator's unused blocks to the device (no-op on cpu).

    The device is chosen as in :func:`synchronize`. The kind module's ``empty_cache()`` takes no device,
    so for an index (explicit or ``LOCAL_RANK``'s) it runs under the kind's device guard (``device(index)``),
    which makes that device current and restores the previous one after.

    Raises:
        UnknownDeviceError: the kind is not built in nor registered.
        DeviceUnavailableError: the kind is known but unusable here.
        DeviceIndexError: the index (explicit or ``LOCAL_RANK``) is not below the number of devices this
            process sees, or ``LOCAL_RANK`` is not an integer.
    """
    spec, index = _spec_and_index(device)
    module = spec.torch_module()
    if index is None:
        module.empty_cache()
        return
    with module.device(index):  # the kind's guard (torch.<name>.device): restores the current device after
        module.empty_cache()


def memory_stats(device: DeviceLike = None) -> dict[str, int]:
    """Memory figures of one device of the resolved kind, in bytes.

    The device is chosen as in :func:`synchronize` (its explicit index, else ``LOCAL_RANK``'s, else the
    current device).

    Returns:
        ``{"allocated": ..., "max_allocated": ..., "reserved": ..., "free": ..., "total": ...}`` (the
        kind's ``memory_allocated``, ``max_memory_allocated``, ``memory_reserved`` and ``mem_get_info`` of
        that device); on cpu the first three are 0 (nothing is counted) and free/total describe host memory.

    Raises:
        UnknownDeviceError: the kind is not built in nor registered.
        DeviceUnavailableError: the kind is known but unusable here.
        DeviceIndexError: the index (explicit or ``LOCAL_RANK``) is not below the number of devices this
            process sees, or ``LOCAL_RANK`` is not an integer.
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
    """Seed torch's host generator and every device generator of the resolved kind.

    Raises:
        ValueError: ``seed`` is not an integer.
        UnknownDeviceError: the kind is not built in nor registered.
        DeviceUnavailableError: the kind is known but unusable here.
        DeviceIndexError: an explicit index this process has no device for.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    torch.manual_seed(seed)
    get_torch_device(device).manual_seed_all(seed)


def describe(kind: str) -> dict[str, Any]:
    """The facts and availability of one kind, as plain data (used by ``hal info``); probes it once.
    ``auto_probe`` says whether automatic resolution may pick it (the simulated npu: only when named).

    Raises:
        UnknownDeviceError: the kind is not built in nor registered.
    """
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
