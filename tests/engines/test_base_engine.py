"""BaseEngine contract: enforced abstract hooks, the flag rule, target resolution, train_step guards."""

from __future__ import annotations

import itertools

import pytest
import torch

import hal
from engines import BaseEngine, EngineStateError, OffloadError, TensorHome, TorchEngine
from tests.engines.models import loss_for, make_model

FLAGS = list(itertools.product([True, False], repeat=3))


def test_abstract_hooks_are_enforced():
    class Incomplete(BaseEngine):
        def _model_holders(self):
            return iter(())

    with pytest.raises(TypeError, match="abstract"):
        Incomplete(torch.nn.Linear(2, 2), None, "cpu")


def _where(engine) -> dict[str, set[str]]:
    """Device types the tensors actually sit on: parameters and buffers, gradients, optimizer states
    (Adam's 0-dim ``step`` counters, kept on the host by the optimizer itself, left out)."""
    params = {t.device.type for t in list(engine.module.parameters()) + list(engine.module.buffers())}
    grads = {p.grad.device.type for p in engine.module.parameters() if p.grad is not None}
    states = {t.device.type for state in engine.optimizer.state.values() for t in state.values()
              if torch.is_tensor(t) and t.dim() > 0}
    return {"model": params, "grad": grads, "optimizer": states}


def _values(engine) -> dict[str, torch.Tensor]:
    out = {f"param.{n}": p.detach().cpu().clone() for n, p in engine.module.named_parameters()}
    out.update({f"grad.{n}": p.grad.detach().cpu().clone() for n, p in engine.module.named_parameters()})
    for i, p in enumerate(engine.module.parameters()):
        out.update({f"state.{i}.{k}": v.detach().cpu().clone() for k, v in engine.optimizer.state[p].items()})
    return out


@pytest.mark.parametrize("model,optimizer,grad", FLAGS)
def test_each_flag_moves_exactly_its_part_and_back(hal_device, model, optimizer, grad):
    module = make_model()
    engine = TorchEngine(module, torch.optim.AdamW(module.parameters(), lr=1e-2), hal_device)
    engine.train_step(loss_for(0, engine.torch_device))  # gradients and optimizer states now exist
    home = hal.resolve_device(hal_device).name
    assert _where(engine) == {"model": {home}, "grad": {home}, "optimizer": {home}}
    values = _values(engine)
    if grad and not model:
        with pytest.raises(OffloadError, match="gradient buffers move only with the model") as info:
            engine.to("cpu", model=model, optimizer=optimizer, grad=grad)
        assert isinstance(info.value, ValueError) and isinstance(info.value, hal.HalError)
        assert _where(engine) == {"model": {home}, "grad": {home}, "optimizer": {home}}
        return
    engine.to("cpu", model=model, optimizer=optimizer, grad=grad)
    moved = {"model": model, "grad": grad, "optimizer": optimizer}
    assert _where(engine) == {part: {"cpu" if moved[part] else home} for part in moved}
    engine.to(hal_device, model=model, optimizer=optimizer, grad=grad)
    assert _where(engine) == {"model": {home}, "grad": {home}, "optimizer": {home}}
    after = _values(engine)
    assert list(after) == list(values)
    assert all(torch.equal(after[k], values[k]) for k in values), [k for k in values if not torch.equal(after[k], values[k])]


def test_unknown_or_foreign_target_is_refused_with_what_is_accepted():
    engine = TorchEngine(make_model(), None, "cpu")
    with pytest.raises(OffloadError, match="no-such-kind"):
        engine.to("no-such-kind")
    with pytest.raises(OffloadError, match="expected a kind name"):
        engine.to(3.5)


def test_target_can_be_the_kind_name_the_device_type_or_a_torch_device(hal_device):
    engine = TorchEngine(make_model(), None, hal_device)
    spec = hal.resolve_device(hal_device)
    for target in (spec.kind, spec.name, hal.get_device(spec), spec):
        engine.to("cpu")
        engine.to(target)
        assert engine.tensor_home().model == spec.name


def test_train_step_needs_an_optimizer():
    engine = TorchEngine(make_model(), None, "cpu")
    with pytest.raises(EngineStateError, match="without one"):
        engine.train_step(lambda m: m(torch.zeros(1, 1, dtype=torch.long)).sum())


def test_placement_is_a_frozen_value():
    p = TensorHome("npu", "cpu", None)
    with pytest.raises(AttributeError):
        p.model = "cpu"
    assert p == TensorHome(model="npu", optimizer="cpu", grad=None)


def test_pin_memory_support_follows_the_kind(hal_device):
    from engines import pin_memory_supported

    spec = hal.resolve_device(hal_device)
    supported = pin_memory_supported(spec)
    assert supported is (spec.supports_pin_memory and not spec.host_memory)
    if supported:  # what the kind declares holds: its pinned host memory is pinned
        assert torch.empty(8, pin_memory=True).is_pinned()
    engine = TorchEngine(make_model(), None, hal_device)
    assert engine.host_buffers.pin is supported


def test_release_host_buffers_only_when_nothing_is_offloaded(hal_device):
    engine = TorchEngine(make_model(), None, hal_device)
    engine.to("cpu")
    held = len(engine.host_buffers)
    engine.release_host_buffers()
    assert len(engine.host_buffers) == held  # still in use by the offloaded parameters
    engine.to(hal_device)
    engine.release_host_buffers()
    assert len(engine.host_buffers) == 0
    engine.to("cpu")
    assert engine.host_buffers.allocations == 2 * held


def test_reserve_carves_one_slab_of_aligned_disjoint_buffers():
    from engines import HostBufferPool
    from engines.host_buffers import SLAB_ALIGNMENT

    pool = HostBufferPool(pin=False)
    likes = {"w": torch.ones(3, 5), "b": torch.ones(7, dtype=torch.bfloat16), "step": torch.tensor(3, dtype=torch.int64),
             "empty": torch.ones(0, 4, dtype=torch.float64), "w2": torch.ones(2, 2, dtype=torch.float64)}
    rounded = [-(-t.numel() * t.element_size() // SLAB_ALIGNMENT) * SLAB_ALIGNMENT for t in likes.values()]
    assert pool.reserve([*likes.items(), ("w", likes["w"])]) == sum(rounded) == 4 * SLAB_ALIGNMENT  # the empty one takes no room
    assert pool.allocations == len(pool) == 5
    bufs = {k: pool.get(k, t) for k, t in likes.items()}
    assert pool.allocations == 5  # get returns the reserved buffers
    assert len({b.untyped_storage().data_ptr() for b in bufs.values()}) == 1
    assert all(b.shape == t.shape and b.dtype == t.dtype and b.is_contiguous() for b, t in
               zip(bufs.values(), likes.values()))
    assert [b.storage_offset() * b.element_size() for b in bufs.values()] == [0, 64, 128, 192, 192]
    for i, b in enumerate(bufs.values()):
        b.fill_(i + 1)
    assert [b.sum().item() for b in bufs.values()] == [15.0, 14.0, 3, 0.0, 20.0]  # disjoint: no overwrite
    assert pool.nbytes == 60 + 14 + 8 + 0 + 32
    assert pool.reserve(likes.items()) == 0 and pool.allocations == 5
    grown = pool.get("w", torch.ones(4, 5))  # a new shape gets an allocation of its own
    assert grown.shape == (4, 5) and grown.untyped_storage().nbytes() == 80 and pool.allocations == 6
    pool.clear()
    assert len(pool) == 0 and pool.nbytes == 0


def test_reserve_splits_slabs_at_slab_bytes_without_splitting_a_buffer():
    from engines import HostBufferPool

    pool = HostBufferPool(pin=False)
    likes = [(i, torch.ones(16 * (i + 1))) for i in range(6)]  # 64, 128, ... 384 bytes
    with pytest.raises(ValueError, match="slab_bytes"):
        pool.reserve(likes, slab_bytes=0)
    assert pool.reserve(likes, slab_bytes=256) == 64 + 128 + 192 + 256 + 320 + 384
    # slabs of at most 256 bytes, in order, a buffer never split (a larger one alone): {0, 1}, {2}, {3}, {4}, {5}
    bufs = [pool.get(k, t) for k, t in likes]
    storages = [b.untyped_storage().data_ptr() for b in bufs]
    assert storages[0] == storages[1] and len(set(storages)) == 5
    assert [b.untyped_storage().nbytes() for b in bufs] == [192, 192, 192, 256, 320, 384]
    assert pool.allocations == len(pool) == 6 and pool.nbytes == 64 + 128 + 192 + 256 + 320 + 384
    for (k, _t), b in zip(likes, bufs):
        b.fill_(k)
    assert [int(b.sum()) for b in bufs] == [k * t.numel() for k, t in likes]
    assert pool.reserve(likes, slab_bytes=256) == 0 and pool.allocations == 6
    pool.clear()
    assert len(pool) == 0 and pool.nbytes == 0
