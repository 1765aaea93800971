"""Process groups through hal: the default group over gloo, standalone store groups, and timeouts."""

import time

import pytest
import torch

import hal
from hal.apps.multiprocess import run_multiprocess

pytestmark = pytest.mark.multiprocess


def _default_group(rank, world_size):
    import torch.distributed as dist

    backend = hal.init_process_group(timeout=20)
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    out = (backend, dist.get_backend(), t.tolist())
    dist.destroy_process_group()
    return out


def test_init_process_group_picks_gloo_on_cpu_and_all_reduces():
    results = run_multiprocess(_default_group, 2, timeout=60)
    assert results[0] == results[1] == ("gloo", "gloo", [3.0] * 4)


def _store_group(rank, world_size):
    store = hal.launcher_store(timeout=20)
    group = hal.new_group_from_store(store, rank, world_size, timeout=20)
    t = torch.arange(6, dtype=torch.float32) if rank == 0 else torch.zeros(6)
    group.broadcast(t, src=0)
    s = torch.tensor([rank + 1.0])
    group.all_reduce(s)
    group.barrier()
    group.close()
    return t.tolist(), s.item()


def test_store_group_broadcast_and_all_reduce_outside_the_default_world():
    results = run_multiprocess(_store_group, 3, timeout=60)
    for rank in range(3):
        assert results[rank] == ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], 6.0)


def _lonely_rendezvous(rank, world_size):
    import os

    os.environ["WORLD_SIZE"] = "2"  # a peer that never comes
    start = time.monotonic()
    try:
        hal.init_process_group(timeout=3)
    except hal.DistributedTimeoutError as exc:
        return ("timeout", time.monotonic() - start, str(exc))
    return ("joined", time.monotonic() - start, "")


def test_rendezvous_with_missing_peer_raises_timeout_error_instead_of_hanging():
    results = run_multiprocess(_lonely_rendezvous, 1, timeout=60)
    kind, elapsed, message = results[0]
    assert kind == "timeout", message
    assert elapsed < 30
    assert "3 s" in message


def _dead_peer(rank, world_size):
    import os

    store = hal.launcher_store(timeout=20)
    group = hal.new_group_from_store(store, rank, world_size, timeout=4)
    group.barrier()
    if rank == 1:
        os._exit(0)  # dies without a word, mid-protocol
    start = time.monotonic()
    try:
        group.broadcast(torch.zeros(1 << 20), src=1)
    except hal.DistributedTimeoutError as exc:
        return ("error", time.monotonic() - start, str(exc))
    return ("completed", time.monotonic() - start, "")


def test_dead_peer_becomes_an_error_within_the_timeout():
    results = run_multiprocess(_dead_peer, 2, timeout=60, expect_failure=True)
    kind, elapsed, message = results[0]
    assert kind == "error", message
    assert elapsed < 20


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="-1"):
        hal.new_group_from_store(None, 0, 1, timeout=-1)


def _host_pair(rank, world_size):
    import torch.distributed as dist

    backend = hal.init_process_group("npu-sim", with_host=True, timeout=30)
    on_device = torch.full((3,), float(rank + 1), device=hal.get_device("npu-sim"))
    on_host = torch.full((2,), float(rank + 10))
    dist.all_reduce(on_device)
    dist.all_reduce(on_host)
    objects = [None] * world_size
    dist.all_gather_object(objects, {"rank": rank})  # host-side objects travel over gloo
    out = (backend, on_device.cpu().tolist(), on_host.tolist(), objects)
    dist.destroy_process_group()
    return out


@pytest.mark.hal_device("npu-sim")
def test_host_pair_backend_serves_device_and_host_tensors(hal_device):
    results = run_multiprocess(_host_pair, 2, timeout=90)
    for rank in range(2):
        backend, dev, host, objects = results[rank]
        assert backend == "cpu:gloo,npu:hccl"
        assert dev == [3.0] * 3 and host == [21.0] * 2
        assert objects == [{"rank": 0}, {"rank": 1}]


def test_each_spec_builds_its_own_backend_and_an_unregistered_one_is_named():
    """Issue 30: hal asks the spec for its communicator (``DeviceSpec.create_backend``), not ``dist_backend``
    compared at the call site: a plugin kind on gloo gets a gloo group, one naming a backend nobody
    registered gets an error naming the backend and the kind."""
    import dataclasses
    import datetime

    import torch.distributed as dist

    from devices.cpu import CpuDevice

    store = dist.HashStore()
    td = datetime.timedelta(seconds=10)
    on_gloo = dataclasses.replace(CpuDevice(), kind="plugin-host")
    assert isinstance(on_gloo.create_backend(store, 0, 1, td), dist.ProcessGroupGloo)
    unregistered = dataclasses.replace(CpuDevice(), kind="plugin-xccl", dist_backend="xccl")
    with pytest.raises(RuntimeError, match="collective backend 'xccl' of device kind 'plugin-xccl' is not registered"):
        unregistered.create_backend(store, 0, 1, td)
