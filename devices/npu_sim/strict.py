"""Strict mode of the npu-sim kind: any call into ``torch.cuda`` from project or user code raises.

With ``HAL_SIM_STRICT=1`` (the pytest plugin sets it) the registered sim wraps every public ``torch.cuda``
function so a call raises :class:`StrictCudaCallError` naming the caller's ``file:line``, unless it comes from
torch, another installed package, the standard library or ``devices/cuda.py``. References taken before
install and ``torch.cuda`` classes are not covered.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import types

from devices.errors import HalError

ENV_VAR = "HAL_SIM_STRICT"
_installed = False
_originals: dict[str, object] = {}  # name -> the torch.cuda function that install() wrapped
_CUDA_PROBE = os.path.join("devices", "cuda.py")


class StrictCudaCallError(HalError, RuntimeError):
    """A ``torch.cuda`` function was called from project or user code while npu-sim strict mode is on."""


def enabled() -> bool:
    """Return whether ``HAL_SIM_STRICT`` asks for strict mode (``1``, ``true``, ``yes``, ``on``)."""
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def _allowed_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths.get("stdlib"), paths.get("platstdlib"), paths.get("purelib"), paths.get("platlib")}
    return tuple(os.path.realpath(r) + os.sep for r in roots if r)


def _is_allowed(filename: str, roots: tuple[str, ...]) -> bool:
    if filename.startswith("<"):  # <frozen ...>, <string>: interpreter machinery
        return filename.startswith("<frozen")
    path = os.path.realpath(filename)
    return path.startswith(roots) or path.endswith(_CUDA_PROBE)


def _guard(name: str, fn, roots: tuple[str, ...]):
    @functools.wraps(fn)
    def strict(*args, **kwargs):
        frame = sys._getframe(1)
        if not _is_allowed(frame.f_code.co_filename, roots):
            raise StrictCudaCallError(
                f"torch.cuda.{name}() called from {frame.f_code.co_filename}:{frame.f_lineno} "
                f"({frame.f_code.co_name}) while {ENV_VAR}=1 on the npu-sim kind: ask hal for the device "
                f"module instead (hal.get_torch_device(), hal.get_device(), hal.synchronize(), ...)")
        return fn(*args, **kwargs)

    strict.__hal_strict__ = True
    return strict


def install() -> None:
    """Wrap the public functions of ``torch.cuda`` (idempotent)."""
    global _installed
    if _installed:
        return
    import torch

    roots = _allowed_roots()
    cuda = torch.cuda
    for name in dir(cuda):
        if name.startswith("_"):
            continue
        value = getattr(cuda, name, None)
        if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)) and not getattr(
                value, "__hal_strict__", False):
            _originals[name] = value
            setattr(cuda, name, _guard(name, value, roots))
    _installed = True


def installed() -> bool:
    """Return whether strict mode is installed in this process."""
    return _installed


def uninstall() -> None:
    """Put back every ``torch.cuda`` function :func:`install` wrapped (idempotent)."""
    global _installed
    if not _installed:
        return
    import torch

    for name, fn in _originals.items():
        setattr(torch.cuda, name, fn)
    _originals.clear()
    _installed = False
