"""The built-in device specs: the backend map and the vendor facts, checked without hardware."""

import sys
import types

import pytest
import torch

import hal
from devices import BUILTIN_KINDS
from devices.base import Availability, DeviceSpec, probe_safely
from devices.npu import NpuDevice

def _available_kinds():
    return [k for k in sorted(BUILTIN_KINDS) if hal.availability(k)]


@pytest.mark.parametrize("kind", sorted(BUILTIN_KINDS))
def test_each_builtin_module_holds_the_spec_of_its_kind(kind):
    spec = hal.registry.get_spec(kind)
    assert spec.kind == kind and isinstance(spec, DeviceSpec)


@pytest.mark.parametrize("kind", _available_kinds())
def test_an_available_kind_makes_tensors_of_its_name_served_by_its_backend(kind):
    # what the spec says is what torch does: tensors of spec.name, and torch's own backend table (filled in by
    # the kind's registration for npu) maps that device type to spec.dist_backend
    spec = hal.resolve_device(kind)
    assert torch.ones(2, device=hal.get_device(kind)).device.type == spec.name
    assert torch.distributed.Backend.default_device_backend_map[spec.name] == spec.dist_backend


def test_cuda_and_nccl_agree_with_torch_default_backend_map():
    # torch's own table says which backend serves cuda tensors; the spec must not disagree with it.
    assert torch.distributed.Backend.default_device_backend_map["cuda"] == hal.registry.get_spec("cuda").dist_backend


@pytest.mark.parametrize("kind", _available_kinds())
def test_availability_of_an_index_outside_the_devices_names_the_range(kind):
    spec = hal.resolve_device(kind)
    count = spec.availability().device_count
    assert spec.availability(count - 1).ok and spec.availability(0).device_count == count
    for bad in (count, -1):
        state = spec.availability(bad)
        assert not state and f"device index {bad}" in state.reason and f"0..{count - 1}" in state.reason


@pytest.mark.parametrize("kind", _available_kinds())
def test_pin_memory_is_declared_where_pinned_host_memory_works(kind):
    spec = hal.resolve_device(kind)
    hal.get_device(kind)
    if spec.supports_pin_memory:
        assert torch.empty(16, pin_memory=True).is_pinned()
    else:
        assert spec.host_memory  # the only built-in kind without it is the one that copies nothing


def test_visible_devices_count_as_read_only_once_the_kind_is_set_up():
    cpu, cuda = hal.registry.get_spec("cpu"), hal.registry.get_spec("cuda")
    assert not cpu.visible_devices_read()  # no variable, nothing to read
    if not hal.availability("cuda"):  # CUDA never initialised here, so its variable can still change
        assert not cuda.visible_devices_read()
    if hal.availability("npu-sim"):  # registered by the probe: it counted its devices then
        assert hal.registry.get_spec("npu-sim").visible_devices_read()


def test_a_simulated_worker_never_asks_ray_for_a_real_device():
    resources = {k: hal.registry.get_spec(k).ray_resource for k in BUILTIN_KINDS}
    assert resources["npu-sim"] not in (resources["npu"], resources["cuda"], None)


def test_npu_unavailable_without_torch_npu_names_the_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu -> ImportError
    state = NpuDevice().availability()
    assert not state
    assert "import torch_npu failed" in state.reason and "torch_npu halted" in state.reason


def _fake_torch_npu(monkeypatch, is_available):
    fake = types.ModuleType("torch_npu")
    npu_module = types.ModuleType("torch.npu")
    npu_module.is_available = is_available
    npu_module.device_count = lambda: 8
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setattr(torch, "npu", npu_module, raising=False)


def test_npu_is_available_that_raises_is_treated_as_unavailable(monkeypatch):
    def broken():
        raise RuntimeError("drvMemGetInfo failed: CANN driver not loaded")

    _fake_torch_npu(monkeypatch, broken)
    state = NpuDevice().availability()
    assert not state
    assert "RuntimeError" in state.reason and "CANN driver not loaded" in state.reason


def test_npu_with_devices_is_available(monkeypatch):
    _fake_torch_npu(monkeypatch, lambda: True)
    state = NpuDevice().availability()
    assert state.ok and state.device_count == 8


def test_torch_npu_import_raising_oserror_is_unavailable(monkeypatch):
    # Without CANN, torch_npu's import fails with OSError (a missing libascendcl.so), not ImportError.
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    finder = types.SimpleNamespace()

    class Loader:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "torch_npu":
                raise OSError("libascendcl.so: cannot open shared object file")
            return None

    monkeypatch.setattr(sys, "meta_path", [Loader] + sys.meta_path)
    state = NpuDevice().availability()
    assert not state and "libascendcl.so" in state.reason
    del finder


def test_probe_safely_passes_keyboard_interrupt_through():
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        probe_safely("x", interrupted)
    assert probe_safely("x", lambda: Availability.available(2)).device_count == 2


def test_cpu_module_offers_the_calls_hal_makes():
    module = hal.registry.get_spec("cpu").torch_module()
    for name in ("is_available", "device_count", "current_device", "set_device", "synchronize", "empty_cache",
                 "memory_allocated", "max_memory_allocated", "mem_get_info", "manual_seed", "manual_seed_all",
                 "Stream", "Event"):
        assert callable(getattr(module, name)), name
    free, total = module.mem_get_info()
    assert 0 < free <= total
