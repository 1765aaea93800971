"""``devices`` is the bottom layer: it imports nothing from ``hal`` (the shared errors live in
:mod:`devices.errors`, and ``hal.errors`` re-exports the same classes)."""

import ast
import pathlib
import subprocess
import sys
import textwrap

import hal
import hal.errors
from devices import errors as device_errors

DEVICES = pathlib.Path(device_errors.__file__).resolve().parent


def _hal_imports(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        found += [f"{path.name}:{node.lineno}: {name}" for name in names if name == "hal" or name.startswith("hal.")]
    return found


def test_no_devices_module_imports_hal_anywhere_in_its_source():
    # every import statement, including ones inside functions (lazy imports run later, not at import time)
    modules = sorted(DEVICES.rglob("*.py"))
    assert len(modules) >= 8, modules
    offenders = [hit for path in modules for hit in _hal_imports(path)]
    assert not offenders, "devices/ must not import hal:\n" + "\n".join(offenders)


def test_the_ast_scan_sees_a_lazy_hal_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from hal.errors import HalError\n    import hal.device as d\n")
    assert _hal_imports(bad) == ["bad.py:2: hal.errors", "bad.py:3: hal.device"]


def test_devices_import_and_register_the_sim_with_hal_blocked():
    # A fresh interpreter where any import of hal fails: every devices module imports, and the npu-sim kind
    # registers (lazy imports included), so nothing in devices needs hal at run time either.
    script = textwrap.dedent("""
        import importlib, pkgutil, sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "hal" or name.startswith("hal."):
                    raise ImportError("hal is blocked in this test: " + name)
        sys.meta_path.insert(0, Block())
        import devices
        names = sorted(m.name for m in pkgutil.iter_modules(devices.__path__, "devices."))
        for name in names:
            importlib.import_module(name)
        import devices.npu_sim
        import torch
        devices.npu_sim.register()
        torch.ones(2, device="npu:0").sum().item()
        leaked = sorted(m for m in sys.modules if m == "hal" or m.startswith("hal."))
        print("imported", len(names), "leaked", leaked)
    """)
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("HAL_DEVICE", "HAL_SIM_STRICT")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "leaked []" in done.stdout, done.stdout


def test_hal_errors_are_the_devices_classes():
    for name in ("HalError", "UnknownDeviceError", "DeviceUnavailableError", "DuplicateDeviceError",
                 "DistributedTimeoutError"):
        assert getattr(hal, name) is getattr(hal.errors, name) is getattr(device_errors, name), name
    assert issubclass(hal.DistributedTimeoutError, TimeoutError)
    assert issubclass(hal.UnknownDeviceError, ValueError)
    assert issubclass(hal.DeviceUnavailableError, RuntimeError)
