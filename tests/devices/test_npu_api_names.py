"""``torch.npu`` names used by hal and offered by the sim exist in real torch_npu (devices/npu_api_names.txt)."""

from __future__ import annotations

import types
import zipfile

import pytest

import hal
from devices import npu_sim as sim
from devices.npu_sim import module as sim_module

from tests.devices.npu_api_names import LIST, REPO, real_names

# Private names that torch itself requires of a device module and torch_npu.npu defines
# (``def _is_in_bad_fork()`` in torch_npu/npu/__init__.py of the 2.14.0 wheel; torch.manual_seed calls it).
TORCH_REQUIRED_PRIVATE = {"_is_in_bad_fork"}
# Submodules of torch_npu.npu (torch_npu/npu/memory.py in the wheel), reached as torch.npu.memory; the name
# list holds the module-level names of torch_npu/npu/__init__.py only.
TORCH_NPU_SUBMODULES = {"memory"}


def _load_extract():
    import importlib.util

    spec = importlib.util.spec_from_file_location("extract_npu_api", REPO / "scripts" / "extract_npu_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_list_records_the_wheel_version():
    header = [line for line in LIST.read_text().splitlines() if line.startswith("#")]
    assert "# version: 2.14.0" in header and any(line.startswith("# wheel: torch_npu-2.14.0") for line in header)
    assert {"synchronize", "memory_allocated", "mem_get_info", "Stream", "Event", "set_device"} <= real_names()


class _Recorder(types.ModuleType):
    """Stands in for torch.npu and records every attribute hal reads from it."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__("recorder")
        self._real, self.used = real, set()

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        self.used.add(name)
        return getattr(self._real, name)


@pytest.mark.skipif(not hal.availability("npu-sim"), reason="npu-sim unavailable")
def test_every_torch_npu_name_hal_uses_is_in_real_torch_npu(monkeypatch):
    recorder = _Recorder(hal.get_torch_device("npu-sim"))
    monkeypatch.setattr(sim.SimNpuDevice, "torch_module", lambda self: recorder)
    hal.get_device("npu-sim")
    hal.get_device_id("npu-sim")
    hal.synchronize("npu-sim")
    hal.empty_cache("npu-sim")
    hal.memory_stats("npu-sim")
    hal.manual_seed(0, "npu-sim")
    hal.distributed.set_device("npu-sim")
    assert {"current_device", "synchronize", "mem_get_info", "memory_allocated", "manual_seed_all"} <= recorder.used
    missing = recorder.used - real_names()
    assert not missing, f"hal uses torch.npu names that torch_npu 2.14.0 lacks: {sorted(missing)}"


@pytest.mark.skipif(not hal.availability("npu-sim"), reason="npu-sim unavailable")
def test_every_name_of_the_sim_module_is_in_real_torch_npu():
    module = hal.get_torch_device("npu-sim")
    offered = {n for n in vars(module) if not n.startswith("__")} - set(sim_module.SIM_EXTRAS) - TORCH_NPU_SUBMODULES
    missing = offered - real_names() - TORCH_REQUIRED_PRIVATE
    assert not missing, f"the sim offers torch.npu names real torch_npu lacks: {sorted(missing)}"


def test_extract_script_reads_a_wheel_without_importing_it(tmp_path):
    extract = _load_extract()
    wheel = tmp_path / "torch_npu-9.9.9-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("torch_npu-9.9.9.dist-info/METADATA", "Metadata-Version: 2.1\nName: torch_npu\nVersion: 9.9.9\n")
        zf.writestr(extract.MODULE_PATH, (
            "raise SystemExit('imported!')\n"
            "__all__ = ['synchronize', 'Stream']\n__all__ += ['extra']\n"
            "from .memory import memory_allocated as memory_allocated, _private\n"
            "import torch_npu.npu.amp as amp\n"
            "def synchronize(): pass\ndef _hidden(): pass\nclass Event: pass\nconfig = object()\n"))
    version, names = extract.extract(wheel)
    assert version == "9.9.9"
    assert names == sorted(["synchronize", "Stream", "extra", "memory_allocated", "amp", "Event", "config"])
    out = tmp_path / "names.txt"
    assert extract.main([str(wheel), "-o", str(out)]) == 0
    text = out.read_text()
    assert "# version: 9.9.9" in text and "\nEvent\n" in text and "_hidden" not in text
