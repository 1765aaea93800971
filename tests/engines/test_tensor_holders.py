"""Holders: why DDP needs storage holders (gradient-accumulator hooks), and their refusals."""

from __future__ import annotations

import pytest
import torch

import hal
from engines import EngineStateError
from engines.tensor_holders import FreedStorages, data_holder, storage_holder


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
    holder = FreedStorages()
    holder = data_holder("p", param) if kind_of_slot == "data" else storage_holder("p", param, holder)
    memory = spec.torch_module()
    before = memory.memory_allocated()
    host = holder.get().to("cpu").clone()
    holder.set(host)
    assert holder.get().device.type == "cpu" and before - memory.memory_allocated() >= 1024
    if holder.load is not None:
        holder.load(host, target, False)
    else:
        holder.set(host.to(target))
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
    holder = storage_holder("half", half, FreedStorages())
    with pytest.raises(EngineStateError, match="shares its storage"):
        holder.set(holder.get().to("cpu"))
