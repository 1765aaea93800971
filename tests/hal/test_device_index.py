"""Device indices: one parser and one range check for every entry point; LOCAL_RANK -> device in one place."""

import pytest
import torch

import hal
from engines import OffloadError, TorchEngine


pytestmark = pytest.mark.hal_device("npu-sim")  # tests taking ``sim`` run on the npu-sim lane


@pytest.fixture
def sim(hal_device):
    """The npu-sim module; the test's current device is restored afterwards (it is per thread)."""
    module = hal.get_torch_device("npu-sim")
    before = module.current_device()
    yield module
    module.set_device(before)


def test_an_index_in_hal_device_is_honoured_like_an_explicit_one(sim, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("HAL_DEVICE", "npu-sim:1")
    assert hal.resolve_device() is hal.resolve_device("npu-sim:1")
    assert hal.get_device() == hal.get_device("npu-sim:1") == torch.device("npu", 1)
    # the explicit index wins over LOCAL_RANK, and binding makes it current
    assert hal.set_device() == torch.device("npu", 1)
    assert sim.current_device() == 1


def test_an_index_out_of_range_is_refused_everywhere_with_the_count(sim, monkeypatch):
    count = sim.device_count()
    for call in (hal.resolve_device, hal.get_device):
        with pytest.raises(hal.DeviceIndexError, match=f"index {count} .*sees {count} npu-sim device"):
            call(f"npu-sim:{count}")
    monkeypatch.setenv("HAL_DEVICE", f"npu-sim:{count}")
    with pytest.raises(hal.DeviceIndexError, match=f"HAL_DEVICE='npu-sim:{count}'"):
        hal.get_device()
    with pytest.raises(hal.DeviceIndexError, match="must be >= 0"):
        hal.resolve_device("npu-sim:-1")


def test_the_host_has_one_device():
    assert hal.get_device("cpu:0") == torch.device("cpu")
    with pytest.raises(hal.DeviceIndexError, match="sees 1 cpu device"):
        hal.get_device("cpu:1")


def test_local_rank_picks_the_device_and_a_rank_past_the_count_is_a_hal_error(sim, monkeypatch):
    monkeypatch.delenv("HAL_DEVICE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert hal.get_device("npu-sim") == torch.device("npu", 2)
    assert hal.set_device("npu-sim") == torch.device("npu", 2) and sim.current_device() == 2
    assert hal.get_device("cpu") == torch.device("cpu")
    count = sim.device_count()
    monkeypatch.setenv("LOCAL_RANK", str(count))
    with pytest.raises(hal.DeviceIndexError) as info:
        hal.set_device("npu-sim")
    assert not isinstance(info.value, IndexError)
    assert f"LOCAL_RANK={count}" in str(info.value) and f"sees {count} npu-sim device(s)" in str(info.value)
    assert "ASCEND_RT_VISIBLE_DEVICES" in str(info.value)
    assert sim.current_device() == 2  # nothing was bound


def _engine(device):
    model = torch.nn.Linear(4, 3)
    return TorchEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), device=device)


def test_an_engine_keeps_its_index_and_refuses_another(sim, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    engine = _engine("npu-sim:1")
    assert engine.torch_device == torch.device("npu", 1)
    engine.train_step(lambda m: m(torch.ones(2, 4, device="npu:1")).square().mean())
    assert {p.device for p in engine.module.parameters()} == {torch.device("npu", 1)}
    synced = []
    monkeypatch.setattr(sim, "synchronize", lambda device=None: synced.append(device))
    sim.set_device(0)
    engine.to("cpu")
    assert synced == [1]  # the copies on npu:1 are waited for, not those of the current npu:0
    engine.to("npu:1")  # its own index is accepted and honoured
    assert {p.device for p in engine.module.parameters()} == {torch.device("npu", 1)}
    states = [t for s in engine.optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert states and {t.device for t in states} == {torch.device("npu", 1)}
    before = [p.detach().cpu().clone() for p in engine.module.parameters()]
    with pytest.raises(OffloadError, match=r"lives on npu:1.*to\(\) moves it between the host and that device"):
        engine.to("npu:0")
    with pytest.raises(OffloadError, match="lives on npu:1"):
        engine.to(torch.device("npu", 0))
    with pytest.raises(OffloadError, match="host has one device"):
        engine.to("cpu:1")
    assert {p.device for p in engine.module.parameters()} == {torch.device("npu", 1)}
    assert all(torch.equal(a, p.detach().cpu()) for a, p in zip(before, engine.module.parameters()))


def test_an_engine_without_an_index_takes_its_local_rank_device(sim, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "2")
    engine = _engine("npu-sim")
    assert engine.torch_device == torch.device("npu", 2)
    assert {p.device for p in engine.module.parameters()} == {torch.device("npu", 2)}
    engine.to("cpu")
    engine.to("npu-sim")
    assert {p.device for p in engine.module.parameters()} == {torch.device("npu", 2)}


def test_placement_tells_two_indices_of_one_type_apart(sim):
    from engines.tensor_home import MIXED, device_type_of

    one = [torch.zeros(2, device="npu:1"), torch.zeros(3, device="npu:1")]
    assert device_type_of(one) == "npu"
    assert device_type_of(one + [torch.zeros(1, device="npu:0")]) == MIXED
    assert device_type_of([torch.zeros(1), torch.zeros(1, device="npu:1")]) == MIXED


def test_the_sims_torch_device_type_resolves_to_the_sim_and_an_absent_kind_still_fails(sim, monkeypatch):
    hal.reset()  # nothing cached: HAL_DEVICE alone makes npu-sim the active kind
    monkeypatch.setenv("HAL_DEVICE", "npu-sim")
    t = torch.zeros(1, device="npu:1")
    for device in (t.device, "npu", "npu:1", torch.device("npu")):
        assert hal.resolve_device(device).kind == "npu-sim"
    assert hal.get_device(t.device) == torch.device("npu", 1)
    assert hal.get_dist_backend(t.device) == "hccl"
    hal.synchronize(t.device)
    with pytest.raises(hal.DeviceIndexError, match=f"sees {sim.device_count()} npu-sim device"):
        hal.resolve_device(f"npu:{sim.device_count()}")
    with pytest.raises(hal.DeviceUnavailableError, match="'cuda' is unavailable.*available kinds: .*npu-sim"):
        hal.resolve_device(torch.device("cuda", 0))
    monkeypatch.delenv("HAL_DEVICE")
    hal.reset()
    hal.resolve_device("npu-sim")  # an available kind found earlier is active too
    assert hal.resolve_device(t.device).kind == "npu-sim"


def test_per_device_calls_act_on_the_index_they_are_given_not_the_current_device(sim, monkeypatch):
    sim.set_device(0)
    before = hal.memory_stats("npu-sim:1")
    x = torch.ones(1 << 20, device="npu:1")  # 4 MiB on npu:1 while npu:0 is current
    stats = hal.memory_stats("npu-sim:1")
    assert stats["allocated"] - before["allocated"] == x.nbytes == 4 << 20
    assert stats["allocated"] == sim.memory_allocated(1) and stats["reserved"] == sim.memory_reserved(1)
    assert (stats["free"], stats["total"]) == sim.mem_get_info(1)
    assert hal.memory_stats(x.device) == stats
    monkeypatch.setenv("HAL_DEVICE", "npu-sim:1")
    assert hal.memory_stats() == stats and hal.get_device_id() == 1
    assert hal.get_device_id("npu-sim:1") == 1 and hal.get_device_id("npu-sim") == 0
    calls = []
    monkeypatch.setattr(sim, "synchronize", lambda device=None: calls.append(("synchronize", device)))
    monkeypatch.setattr(sim, "empty_cache", lambda: calls.append(("empty_cache", sim.current_device())))
    hal.synchronize("npu-sim:1")
    hal.empty_cache(x.device)
    hal.empty_cache("npu-sim")
    assert calls == [("synchronize", 1), ("empty_cache", 1), ("empty_cache", 0)]
    assert sim.current_device() == 0


def test_a_launched_rank_defaults_to_its_local_device_without_binding(sim, monkeypatch):
    # torch.distributed.run / hal launch set LOCAL_RANK; nothing binds a device (the current one stays 0)
    monkeypatch.setenv("HAL_DEVICE", "npu-sim")
    monkeypatch.setenv("LOCAL_RANK", "1")
    sim.set_device(0)
    assert hal.get_device() == hal.get_device("npu-sim") == hal.get_device(torch.device("npu")) == torch.device("npu", 1)
    assert hal.get_device() == torch.device("npu", 1) and hal.get_device_id() == 1
    assert sim.current_device() == 0  # reading the default device binds nothing
    # an explicit index, in the argument or in HAL_DEVICE, still wins over LOCAL_RANK
    assert hal.get_device("npu-sim:2") == torch.device("npu", 2) and hal.get_device_id("npu:3") == 3
    monkeypatch.setenv("HAL_DEVICE", "npu-sim:2")
    assert hal.get_device() == torch.device("npu", 2)
    # without LOCAL_RANK (a plain process): the current device, as before
    monkeypatch.setenv("HAL_DEVICE", "npu-sim")
    monkeypatch.delenv("LOCAL_RANK")
    sim.set_device(3)
    assert hal.get_device() == torch.device("npu", 3) and hal.get_device_id() == 3


def test_a_local_rank_the_process_has_no_device_for_is_refused_by_get_device(sim, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", str(sim.device_count()))
    with pytest.raises(hal.DeviceIndexError, match=f"LOCAL_RANK={sim.device_count()} .*sees {sim.device_count()} "):
        hal.get_device("npu-sim")
    monkeypatch.setenv("LOCAL_RANK", "one")
    with pytest.raises(hal.DeviceIndexError, match="LOCAL_RANK='one' is not an integer"):
        hal.get_device_id("npu-sim")
    assert hal.get_device("cpu") == torch.device("cpu")  # the host kind has no per-rank device


def test_per_device_calls_of_a_launched_rank_act_on_its_local_device(sim, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    sim.set_device(0)
    x = torch.ones(1 << 18, device=hal.get_device("npu-sim"))  # 1 MiB on this rank's npu:1
    assert x.device == torch.device("npu", 1)
    stats = hal.memory_stats("npu-sim")
    assert stats == hal.memory_stats("npu-sim:1") and stats["allocated"] == sim.memory_allocated(1) >= x.nbytes
    calls = []
    monkeypatch.setattr(sim, "synchronize", lambda device=None: calls.append(("synchronize", device)))
    monkeypatch.setattr(sim, "empty_cache", lambda: calls.append(("empty_cache", sim.current_device())))
    hal.synchronize("npu-sim")
    hal.empty_cache("npu-sim")
    assert calls == [("synchronize", 1), ("empty_cache", 1)]
    assert sim.current_device() == 0


def test_a_launched_ranks_engine_and_input_meet_on_its_device(sim, monkeypatch):
    monkeypatch.setenv("HAL_DEVICE", "npu-sim")
    monkeypatch.setenv("LOCAL_RANK", "1")
    sim.set_device(0)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    expected = model(torch.ones(2, 4)).detach()
    engine = TorchEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert engine.torch_device == hal.get_device() == torch.device("npu", 1)
    out = engine.module(torch.ones(2, 4, device=hal.get_device()))
    assert out.device == torch.device("npu", 1) and torch.equal(out.detach().cpu(), expected)
    # what the user's rank did before: an input on the current device, npu:0, which a device refuses
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device, but got mat1 is on "
                                           "npu:0, different from other tensors on npu:1"):
        engine.module(torch.ones(2, 4, device="npu:0"))
