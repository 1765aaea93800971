"""The one registry of device kinds: built-ins from :mod:`devices`, plugins from entry points.

A package adds a kind in its ``pyproject.toml``::

    [project.entry-points."hal.devices"]
    xpu = "my_pkg.xpu:SPEC"      # a devices.base.DeviceSpec instance (or a zero-argument callable)

Plugins load on the first lookup, never at ``import hal``; a duplicate name raises DuplicateDeviceError.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from devices import BUILTIN_KINDS, FALLBACK_KIND
from devices.base import DeviceSpec
from hal.errors import DuplicateDeviceError, UnknownDeviceError

ENTRY_POINT_GROUP = "hal.devices"

_specs: dict[str, DeviceSpec] = {}
_plugin_kinds: list[str] = []
_plugin_errors: dict[str, str] = {}
_plugins_loaded = False


def register_device(spec: DeviceSpec) -> DeviceSpec:
    """Add a device kind under ``spec.kind`` and return ``spec``; raises DuplicateDeviceError for a taken name."""
    if not isinstance(spec, DeviceSpec):
        raise TypeError(f"register_device expects a devices.base.DeviceSpec, got {type(spec).__name__}")
    if spec.kind in BUILTIN_KINDS or spec.kind in _plugin_kinds:
        raise DuplicateDeviceError(f"device kind {spec.kind!r} is already registered; known kinds: {known_kinds()}")
    _plugin_kinds.append(spec.kind)
    _specs[spec.kind] = spec
    return spec


def unregister_device(kind: str) -> None:
    """Remove a plugin kind (an unknown one is ignored); raises ValueError for a built-in kind."""
    if kind in BUILTIN_KINDS:
        raise ValueError(f"built-in device kind {kind!r} cannot be unregistered")
    if kind in _plugin_kinds:
        _plugin_kinds.remove(kind)
        _specs.pop(kind, None)


def _load_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
            spec = obj() if callable(obj) and not isinstance(obj, DeviceSpec) else obj
            if spec.kind != ep.name:
                raise ValueError(f"entry point {ep.name!r} provides a spec whose kind is {spec.kind!r}")
            register_device(spec)
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not break every other kind (its error is kept)
            _plugin_errors[ep.name] = f"{type(exc).__name__}: {exc}"


def reload_plugins() -> None:
    """Forget every plugin kind and load the ``hal.devices`` entry points again (tests, or after an install)."""
    global _plugins_loaded
    for kind in list(_plugin_kinds):
        unregister_device(kind)
    _plugin_errors.clear()
    _plugins_loaded = False
    _load_plugins()


def known_kinds() -> list[str]:
    """Return every selectable kind, in automatic-resolution order: npu, cuda, plugins, cpu (npu-sim listed too)."""
    _load_plugins()
    builtins = [k for k in BUILTIN_KINDS if k != FALLBACK_KIND]
    return builtins + list(_plugin_kinds) + [FALLBACK_KIND]


def plugin_errors() -> dict[str, str]:
    """Return the ``hal.devices`` entry points that failed to load, with their error text."""
    _load_plugins()
    return dict(_plugin_errors)


def get_spec(kind: str) -> DeviceSpec:
    """Return the spec of ``kind``, importing its built-in module on first use."""
    if not isinstance(kind, str):
        raise UnknownDeviceError(f"device kind must be a string, got {kind!r}")
    kind = kind.strip().lower()
    if kind in _specs:
        return _specs[kind]
    if kind in BUILTIN_KINDS:
        spec = importlib.import_module(BUILTIN_KINDS[kind]).SPEC
        _specs[kind] = spec
        return spec
    _load_plugins()
    if kind in _specs:
        return _specs[kind]
    broken = "".join(f"; plugin {k!r} failed to load: {v}" for k, v in _plugin_errors.items())
    raise UnknownDeviceError(f"unknown device kind {kind!r}; known kinds: {', '.join(known_kinds())}{broken}")
