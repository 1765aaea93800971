"""Slots: why DDP needs storage slots (gradient-accumulator hooks), and their refusals."""

from __future__ import annotations

import pytest
import torch

import hal
from engines import EngineStateError
from engines.slots import StorageHolder, data_slot, storage_slot


def _accumulator(p: torch.Tensor):
    return p.view_as(p).grad_fn.next_functions[0][0]


@pytest.mark.parametrize("kind_of_slot", ["data", "storage"])
def test_accumulator_hooks_survive_only_a_storage_round_trip(hal_device, kind_of_slot):
    spec = hal.resolve_device(hal_device)
    if spec.host_memory:
        pytest.skip("on the cpu kind nothing changes device")
    target = hal.get_device(spec)
    param = torch.nn.Parameter(torch.arange(256.0, device=target))
    fired = []
    accumulator = _accumulator(param)  # held, as DDP's reducer holds it (autograd keeps only a weak ref)
    accumulator.register_hook(lambda *args: fired.append(1))
    holder = StorageHolder()
    slot = data_slot("p", param) if kind_of_slot == "data" else storage_slot("p", param, holder)
    memory = spec.torch_module()
    before = memory.memory_allocated()
    host = slot.get().to("cpu").clone()
    slot.set(host)
    assert slot.get().device.type == "cpu" and before - memory.memory_allocated() >= 1024
    if slot.load is not None:
        slot.load(host, target, False)
    else:
        slot.set(host.to(target))
    assert torch.equal(param.detach().cpu(), torch.arange(256.0)) and param.device == target
    (param * 2).sum().backward()
    assert fired == ([1] if kind_of_slot == "storage" else [])  # a device change drops the old accumulator
    assert (_accumulator(param) is accumulator) == (kind_of_slot == "storage")


def test_storage_slot_refuses_a_tensor_sharing_its_storage(hal_device):
    spec = hal.resolve_device(hal_device)
    if spec.host_memory:
        pytest.skip("on the cpu kind nothing is offloaded")
    flat = torch.zeros(8, device=hal.get_device(spec))
    half = torch.nn.Parameter(flat[4:])
    slot = storage_slot("half", half, StorageHolder())
    with pytest.raises(EngineStateError, match="shares its storage"):
        slot.set(slot.get().to("cpu"))
