"""TorchEngine.to(): what moves, where, with what memory, and that training stays bit-identical.

On the cpu kind an offload moves nothing (its tensors already live in host memory), so there the tests
check exactly that; movement, pinned reuse, memory release and exactness show on npu-sim (and on cuda/npu
where present).
"""

from __future__ import annotations

import itertools

import pytest
import torch

import hal
from engines import OffloadError, TorchEngine, pin_memory_supported
from tests.engines.models import host_copy, loss_for, make_model

ALL_FLAGS = list(itertools.product([True, False], repeat=3))
STEPS = 3


def _moves(device) -> bool:
    return not hal.resolve_device(device).host_memory


def _engine(device, optimizer_cls=torch.optim.AdamW, seed=0, **opt_kwargs):
    model = make_model(seed)
    kwargs = {"lr": 1e-2, **opt_kwargs}
    optimizer = optimizer_cls(model.parameters(), **kwargs) if optimizer_cls else None
    return TorchEngine(model, optimizer, device)


def _state_tensors(engine):
    """[(param index, key, tensor)] for every tensor in the optimizer state."""
    out = []
    params = [p for g in engine.optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for k, v in engine.optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                out.append((i, k, v))
    return out


@pytest.mark.parametrize("model,optimizer,grad", ALL_FLAGS, ids=lambda v: str(int(v)))
def test_offload_between_steps_is_bit_identical_for_every_flag_combination(hal_device, model, optimizer, grad):
    reference, engine = _engine(hal_device), _engine(hal_device)
    spec = hal.resolve_device(hal_device)
    home = spec.name
    for step in range(STEPS):
        loss_ref = reference.train_step(loss_for(step, reference.torch_device))
        loss = engine.train_step(loss_for(step, engine.torch_device))
        assert loss == loss_ref
        if grad and not model:
            with pytest.raises(OffloadError):
                engine.to("cpu", model=model, optimizer=optimizer, grad=grad)
            assert engine.tensor_home() == reference.tensor_home()
            continue
        engine.to("cpu", model=model, optimizer=optimizer, grad=grad)
        where = engine.tensor_home()
        if _moves(hal_device):
            assert where.model == ("cpu" if model else home)
            assert where.grad == ("cpu" if grad else home)
            assert where.optimizer == ("cpu" if optimizer else home)
            assert (engine.last_moved_bytes > 0) == (model or optimizer)
        else:
            assert where == reference.tensor_home() and engine.last_moved_bytes == 0
        engine.to(hal_device, model=model, optimizer=optimizer, grad=grad)
        assert engine.tensor_home() == reference.tensor_home() == type(where)(home, home, home)
    ref, got = host_copy(reference.get_per_tensor_param()[0]), host_copy(engine.get_per_tensor_param()[0])
    assert list(ref) == list(got)
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
    for (_, k1, a), (_, k2, b) in zip(_state_tensors(reference), _state_tensors(engine), strict=True):
        assert k1 == k2 and a.device == b.device and torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("optimizer_cls,kwargs,keys", [
    (torch.optim.AdamW, {"amsgrad": True}, {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
    (torch.optim.SGD, {"momentum": 0.9}, {"momentum_buffer"}),
    (torch.optim.Adagrad, {}, {"step", "sum"}),
    (torch.optim.RMSprop, {"centered": True, "momentum": 0.5}, {"step", "square_avg", "momentum_buffer",
                                                              "grad_avg"}),
], ids=["adamw-amsgrad", "sgd-momentum", "adagrad", "rmsprop-centered"])
def test_every_optimizer_state_tensor_moves_whatever_its_key(hal_device, optimizer_cls, kwargs, keys):
    engine = _engine(hal_device, optimizer_cls, **kwargs)
    engine.train_step(loss_for(0, engine.torch_device))
    states = _state_tensors(engine)
    assert {k for _, k, _ in states} == keys
    before = {(i, k): (t.device, t.clone()) for i, k, t in states}
    engine.to("cpu", model=False, optimizer=True, grad=False)
    for i, k, t in _state_tensors(engine):
        home, value = before[(i, k)]
        host_scalar = home.type == "cpu" and t.dim() == 0  # Adam's step: the optimizer keeps it on the host
        assert t.device.type == "cpu" or host_scalar
        assert torch.equal(t.cpu(), value.cpu()), (i, k)
    assert engine.tensor_home().model == hal.resolve_device(hal_device).name  # params stayed resident
    engine.to(hal_device, model=False, optimizer=True, grad=False)
    for i, k, t in _state_tensors(engine):
        assert t.device == before[(i, k)][0] and torch.equal(t.cpu(), before[(i, k)][1].cpu()), (i, k)
    engine.train_step(loss_for(1, engine.torch_device))  # the step counters are still usable


def test_optimizer_that_never_stepped_gains_no_state(hal_device):
    engine = _engine(hal_device)
    for _ in range(2):
        engine.to("cpu")
        assert len(engine.optimizer.state) == 0 and engine.tensor_home().optimizer == "cpu"
        engine.to(hal_device)
        assert len(engine.optimizer.state) == 0
    assert engine.tensor_home().optimizer == hal.resolve_device(hal_device).name
    engine.train_step(loss_for(0, engine.torch_device))
    assert len(engine.optimizer.state) == len(list(engine.module.parameters()))


def test_parameter_identity_and_tied_weights_survive_round_trips(hal_device):
    engine = _engine(hal_device)
    engine.train_step(loss_for(0, engine.torch_device))
    module = engine.module
    params = list(module.parameters())
    ids = [id(p) for p in params]
    values = host_copy(module.named_parameters())
    for _ in range(2):
        engine.to("cpu")
        assert module.head.weight is module.embed.weight
        engine.to(hal_device)
    assert [id(p) for p in module.parameters()] == ids
    assert [id(p) for g in engine.optimizer.param_groups for p in g["params"]] == ids
    assert module.head.weight is module.embed.weight
    assert set(engine.optimizer.state) == set(params)
    got = host_copy(module.named_parameters())
    assert all(torch.equal(values[n], got[n]) for n in values)
    tied = dict(engine.get_per_tensor_param()[0])
    assert torch.equal(tied["head.weight"].cpu(), tied["embed.weight"].cpu())


def test_host_buffers_are_pinned_where_supported_and_reused(hal_device):
    engine = _engine(hal_device)
    engine.train_step(loss_for(0, engine.torch_device))
    engine.to("cpu")
    host = {n: p.data for n, p in engine.module.named_parameters()}
    if not _moves(hal_device):
        assert engine.last_moved_bytes == 0 and len(engine.host_buffers) == 0
        return
    first = engine.host_buffers.allocations
    params = list(engine.module.parameters())
    # one host buffer per distinct parameter (tied weight once), buffer, gradient, and AdamW's exp_avg and
    # exp_avg_sq (its 0-dim host ``step`` stays where it is)
    assert first == len(engine.host_buffers) == 4 * len(params) + 1
    pinned = pin_memory_supported(hal.resolve_device(hal_device))
    assert all(t.device.type == "cpu" and t.is_pinned() == pinned for t in host.values())
    assert len({t.untyped_storage().data_ptr() for t in host.values()}) == 1  # one slab for the first offload
    ptrs = {n: t.data_ptr() for n, t in host.items()}
    engine.to(hal_device)
    engine.train_step(loss_for(1, engine.torch_device))
    engine.to("cpu")
    assert engine.host_buffers.allocations == first  # the second offload allocated no host buffer
    assert {n: p.data_ptr() for n, p in engine.module.named_parameters()} == ptrs


def test_device_memory_is_released_by_the_bytes_moved(hal_device):
    """Offloading frees the moved bytes on the device and hands them back to it: ``allocated`` and the
    caching allocator's ``reserved`` (in use plus cached free blocks, which only ``empty_cache`` returns)
    both drop by at least the bytes moved."""
    engine = _engine(hal_device)
    own = f"{engine.device.kind}:{engine.torch_device.index}" if _moves(hal_device) else hal_device
    engine.train_step(loss_for(0, engine.torch_device))
    hal.synchronize(own)
    before = hal.memory_stats(own)
    engine.to("cpu")
    after = hal.memory_stats(own)
    if not _moves(hal_device):
        assert engine.last_moved_bytes == 0
        return
    if before["allocated"] == 0 or before["reserved"] == 0:
        pytest.skip(f"device kind {hal_device!r} does not report memory_allocated / memory_reserved")
    assert engine.last_moved_bytes == engine.host_buffers.nbytes > 0
    assert before["allocated"] - after["allocated"] >= engine.last_moved_bytes
    assert before["reserved"] - after["reserved"] >= engine.last_moved_bytes  # returned, not only cached
    engine.to(hal_device)
    assert hal.memory_stats(own)["allocated"] - after["allocated"] >= engine.last_moved_bytes


def test_forward_only_engine_offloads_parameters(hal_device):
    engine = _engine(hal_device, optimizer_cls=None)
    tokens = torch.arange(8).reshape(1, 8).to(engine.torch_device)
    with torch.no_grad():
        expected = engine.module(tokens).cpu()
    engine.to("cpu")
    where = engine.tensor_home()
    assert where.optimizer is None and where.grad is None
    assert where.model == "cpu"
    distinct = list(engine.module.parameters()) + list(engine.module.buffers())  # tied weight counted once
    moved = sum(t.numel() * t.element_size() for t in distinct) if _moves(hal_device) else 0
    assert engine.last_moved_bytes == moved
    engine.to(hal_device)
    with torch.no_grad():
        assert torch.equal(engine.module(tokens).cpu(), expected)


def test_to_twice_is_safe_and_moves_nothing_the_second_time(hal_device):
    engine = _engine(hal_device)
    engine.train_step(loss_for(0, engine.torch_device))
    values = host_copy(engine.get_per_tensor_param()[0])
    engine.to("cpu")
    first = engine.last_moved_bytes
    engine.to("cpu")
    assert engine.last_moved_bytes == 0 and (first > 0) == _moves(hal_device)
    engine.to(hal_device)
    engine.to(hal_device)
    assert engine.last_moved_bytes == 0
    got = host_copy(engine.get_per_tensor_param()[0])
    assert all(torch.equal(values[n], got[n]) for n in values)


def test_train_step_refuses_while_offloaded(hal_device):
    if not _moves(hal_device):
        pytest.skip("on the cpu kind nothing is ever offloaded")
    from engines import EngineStateError

    engine = _engine(hal_device)
    engine.train_step(loss_for(0, engine.torch_device))
    engine.to("cpu", model=False, optimizer=True, grad=False)
    with pytest.raises(EngineStateError, match="optimizer tensors are offloaded"):
        engine.train_step(loss_for(1, engine.torch_device))


def test_per_tensor_params_follow_state_dict_order_with_tied_names(hal_device):
    engine = _engine(hal_device)
    names = [n for n, _ in engine.get_per_tensor_param()[0]]
    assert names == list(engine.module.state_dict())
    assert "head.weight" in names and "embed.weight" in names and "scale" in names


def test_copies_are_synchronized_once_before_to_returns(hal_device, monkeypatch):
    engine = _engine(hal_device)
    engine.train_step(loss_for(0, engine.torch_device))
    calls = []
    real = hal.synchronize
    monkeypatch.setattr(hal, "synchronize", lambda spec=None: (calls.append(engine.tensor_home()), real(spec)))
    engine.to("cpu")
    engine.to(hal_device)
    if not _moves(hal_device):
        assert calls == []  # nothing copied, nothing to wait for
        return
    home = hal.resolve_device(hal_device).name
    # one wait per direction, after every tensor was issued (placement already final when it runs)
    assert [(w.model, w.grad, w.optimizer) for w in calls] == [("cpu",) * 3, (home,) * 3]
