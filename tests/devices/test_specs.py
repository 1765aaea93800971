"""The built-in device specs: the backend map and the vendor facts, checked without hardware."""

import dataclasses
import sys
import types

import pytest
import torch

import hal
from devices import BUILTIN_KINDS
from devices.base import Availability, probe_safely
from devices.npu import NpuDevice

EXPECTED = {
    # kind: (torch.device type, dist backend, visible-devices variable, Ray resource)
    "cuda": ("cuda", "nccl", "CUDA_VISIBLE_DEVICES", "GPU"),
    "npu": ("npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES", "NPU"),
    "npu-sim": ("npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES", "NPU_SIM"),  # its own Ray resource
    "cpu": ("cpu", "gloo", None, None),
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_every_kind_maps_to_its_backend_and_environment(kind):
    spec = hal.registry.get_spec(kind)
    assert (spec.name, spec.dist_backend, spec.visible_devices_env, spec.ray_resource) == EXPECTED[kind]
    assert spec.kind == kind


def test_builtin_list_is_exactly_the_expected_kinds():
    assert set(BUILTIN_KINDS) == set(EXPECTED)


def test_specs_are_immutable():
    spec = hal.registry.get_spec("cuda")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.dist_backend = "gloo"


def test_cuda_and_nccl_agree_with_torch_default_backend_map():
    # torch's own table says which backend serves cuda tensors; the spec must not disagree with it.
    assert torch.distributed.Backend.default_device_backend_map["cuda"] == hal.registry.get_spec("cuda").dist_backend
    assert torch.distributed.Backend.default_device_backend_map["cpu"] == hal.registry.get_spec("cpu").dist_backend


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
