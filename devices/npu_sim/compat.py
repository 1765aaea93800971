"""``import torch_npu`` on the simulated npu, and the guard that tells that module from the real package.

Consumers detect Ascend by importing ``torch_npu`` or asking ``importlib.util.find_spec("torch_npu")``
(verl's ``PlatformNPU``, accelerate, transformers). Once the sim is registered, :func:`install_finder`
puts a meta-path finder first on ``sys.meta_path`` that answers ``torch_npu`` with
``devices/npu_sim/torch_npu.py`` under that name: a real module with a ``__spec__`` (origin: that file), a
``__version__``, ``torch_npu.npu`` being the sim's ``torch.npu`` (also ``sys.modules["torch_npu.npu"]``),
and the fused operators of :mod:`devices.npu_sim.ops`. It carries ``__hal_sim__ = True``.

The real package always wins: the sim never registers where :func:`real_torch_npu_origin` finds one, and
the finder steps aside for it. "Real" means what the torch-npu wheel installs: a regular package whose
folder holds the compiled ``_C`` extension (``torch_npu/_C.*.so``). An empty ``torch_npu/`` folder on
``PYTHONPATH`` (a namespace package), a ``torch_npu.py`` file, or this compatibility module are not.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import pathlib
import sys
import types

from devices.base import SIMULATION_MARKER, is_simulation

COMPAT_FILE = pathlib.Path(__file__).with_name("torch_npu.py")
VERSION = "2.14.0+hal.sim"
"""``torch_npu.__version__`` of the compatibility module: the torch_npu API level it mirrors (the committed
``devices/npu_api_names.txt``), with a local label that marks it as the simulation."""

MARKER = SIMULATION_MARKER


def is_compat(module: types.ModuleType | None) -> bool:
    """Whether ``module`` is this compatibility module (not a real torch_npu)."""
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
    """Where the real ``torch_npu`` package would be imported from, or ``None`` when there is none.

    Looks at an already imported ``torch_npu`` first, then asks every finder on ``sys.meta_path`` except
    this module's; imports nothing.
    """
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
