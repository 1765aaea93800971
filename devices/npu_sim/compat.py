"""``import torch_npu`` on the simulated npu, and the guard that tells that module from the real package.

Once the sim is registered, :func:`install_finder` answers ``torch_npu`` with ``devices/npu_sim/torch_npu.py``
(a real module with ``__spec__``, ``__version__``, ``torch_npu.npu`` and ``__hal_sim__ = True``), so consumers
that detect Ascend by importing it (verl, accelerate, transformers) find it. The real package always wins:
"real" means a regular package holding the compiled ``torch_npu/_C.*.so``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import pathlib
import sys
import types

from devices.base import SIMULATION_MARKER, is_simulation

COMPAT_FILE = pathlib.Path(__file__).with_name("torch_npu.py")
# torch_npu.__version__ of the compatibility module: the API level it mirrors, with a simulation label.
VERSION = "2.14.0+hal.sim"

MARKER = SIMULATION_MARKER


def is_compat(module: types.ModuleType | None) -> bool:
    """Return whether ``module`` is this compatibility module (not a real torch_npu)."""
    return is_simulation(module)


def _is_real_spec(spec: importlib.machinery.ModuleSpec | None) -> bool:
    if spec is None or not spec.origin or spec.origin == "namespace" or not spec.submodule_search_locations:
        return False  # not found, a namespace package (an empty folder), or a plain module file
    origin = pathlib.Path(spec.origin)
    if origin.resolve() == COMPAT_FILE.resolve():
        return False
    folder = origin.parent
    return any(folder.glob("_C.*.so")) or any(folder.glob("_C.*.pyd")) or any(folder.glob("_C.so"))


def real_torch_npu_origin() -> str | None:
    """Return where the real ``torch_npu`` would be imported from, or ``None``; imports nothing."""
    loaded = sys.modules.get("torch_npu")
    if loaded is not None:
        if is_compat(loaded):
            return None
        spec = getattr(loaded, "__spec__", None)
        return spec.origin if _is_real_spec(spec) else None
    for finder in sys.meta_path:
        if isinstance(finder, CompatFinder) or not hasattr(finder, "find_spec"):
            continue
        try:
            spec = finder.find_spec("torch_npu", None)
        except (ImportError, ValueError, AttributeError):
            continue
        if spec is not None:
            return spec.origin if _is_real_spec(spec) else None
    return None


class CompatFinder(importlib.abc.MetaPathFinder):
    """Answers ``import torch_npu`` with the compatibility module while no real torch_npu exists."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch_npu" or real_torch_npu_origin() is not None:
            return None
        spec = importlib.machinery.ModuleSpec(
            "torch_npu", importlib.machinery.SourceFileLoader("torch_npu", str(COMPAT_FILE)),
            origin=str(COMPAT_FILE), is_package=True)
        spec.submodule_search_locations = []  # a package with no folder: torch_npu.<x> only from sys.modules
        spec.has_location = True
        return spec


def install_finder() -> None:
    """Put :class:`CompatFinder` first on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, CompatFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, CompatFinder())
