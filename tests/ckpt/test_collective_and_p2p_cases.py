"""Failures from public bug reports (issue 20), on the one-to-many engines: bucket sizes that differ between
the two sides, a sender that reuses one staging buffer, overlapping views of one storage, and a transfer
run from an executor thread."""

import asyncio
import concurrent.futures

import pytest
import torch
import torch.distributed as dist

import ckpt
import hal
from ckpt.testing import collect, standalone_engine, standalone_pair
from hal.apps.multiprocess import run_multiprocess
from tests.ckpt import mp_workers

ENGINES = ["collective", "nixl", "mooncake"]


def _pair(name, device, bucket_size=4096, direct_threshold=None):
    ok, reason = ckpt.checkpoint_engine_availability(name, device)
    if not ok:
        pytest.skip(f"{name}: {reason}")
    devices = (None, None) if hal.is_host(device) else (f"{device}:0", f"{device}:1")  # a device per rank
    return standalone_pair(name, devices, device=device, bucket_size=bucket_size,
                           timeout=20, direct_threshold=direct_threshold)


async def _send_receive(sender, receiver, weights, step=1):
    _, got = await asyncio.gather(sender.send_weights(weights, step), collect(receiver.receive_weights(step)))
    return got


def _close(*engines):
    for engine in engines:
        engine.close()


def _reusing_one_staging_buffer(values, numel, device):
    """vLLM 43163/43464: every tensor is written into one staging buffer and a view of it is yielded."""
    staging = torch.empty(numel, device=device)
    for i, value in enumerate(values):
        staging.fill_(value)
        yield f"w{i}", staging


@pytest.mark.parametrize("name", ENGINES)
@pytest.mark.parametrize("numel", [16, 75, 3000])  # 64 B and 300 B (packed), 12 KB (larger than a bucket)
def test_a_sender_reusing_one_staging_buffer_delivers_each_tensors_own_bytes(name, numel, hal_device):
    """The collective engine delivered w0..w4 all equal to the last value at a 4 KiB bucket (and shifted by
    one tensor where tensors were sent from their own memory): each tensor's bytes are taken when yielded."""
    values = [float(i + 1) for i in range(5)]
    sender, receiver = _pair(name, hal_device, bucket_size=4096, direct_threshold=64)
    try:
        got = asyncio.run(_send_receive(sender, receiver,
                                        _reusing_one_staging_buffer(values, numel, hal.get_device(sender.device_kind))))
    finally:
        _close(sender, receiver)
    assert [n for n, _ in got] == [f"w{i}" for i in range(5)]
    assert [t.unique().tolist() for _, t in got] == [[v] for v in values]


@pytest.mark.parametrize("name", ENGINES)
@pytest.mark.parametrize("sizes", [(4096, 65536), (65536, 4096)])
def test_bucket_sizes_that_differ_are_adopted_or_refused_naming_both(name, sizes):
    """Trainer 4 KiB and rollout 64 KiB: nixl and mooncake delivered wrong bytes; trainer 64 KiB and rollout
    4 KiB on the collective engine: gloo's EnforceNotMet killed the rollout. The collective receiver adopts
    the sender's layout (carried by every message); nixl and mooncake refuse before any byte moves."""
    ok, reason = ckpt.checkpoint_engine_availability(name, "cpu")
    if not ok:
        pytest.skip(f"{name}: {reason}")
    results = run_multiprocess(mp_workers.bucket_size_mismatch, 2, name, "cpu", sizes, timeout=90)
    if name == "collective":
        assert results[1] == ("ok", [(f"w{i}", [float(i)]) for i in range(8)])
        return
    for rank in (0, 1):
        status, kind, text = results[rank]
        assert (status, kind) == ("error", "CheckpointConfigError"), results[rank]
        assert "bucket_size mismatch" in text and str(sizes[0]) in text and str(sizes[1]) in text, text


@pytest.mark.parametrize("name", ["nixl", "mooncake"])
def test_overlapping_views_of_one_storage_are_registered_once(name):
    """Mooncake refused the second registration of overlapping memory (register_memory of 65536 bytes
    returned -7) and the update was lost: each storage is registered once, whatever views of it are sent."""
    flat = torch.arange(64 << 10, dtype=torch.float32)  # 256 KiB
    weights = [("a", flat[:16384]), ("b", flat[8192:24576]), ("a_again", flat[:16384]), ("c", flat[30000:31000])]
    sender, receiver = _pair(name, "cpu", bucket_size=1 << 20, direct_threshold=1024)
    try:
        got = asyncio.run(_send_receive(sender, receiver, weights))
        assert not sender._sources  # every registration was released after the update
    finally:
        _close(sender, receiver)
    assert [n for n, _ in got] == ["a", "b", "a_again", "c"]
    for (_, sent), (_, received) in zip(weights, got):
        assert torch.equal(sent, received)


@pytest.mark.hal_device("npu-sim")
@pytest.mark.parametrize("name", ENGINES)
def test_a_transfer_run_from_an_executor_thread_keeps_the_engines_device(name, hal_device):
    """verl 7416: a transfer run from an executor thread used that thread's current device (npu:0) instead
    of the rank's (npu:1): the simulated HCCL refused two ranks on one device. Each engine is built for the
    device current where it is made and binds it on every call, whatever thread makes the call."""
    torch_device = hal.get_torch_device(hal_device)
    ok, reason = ckpt.checkpoint_engine_availability(name, hal_device)
    if not ok:
        pytest.skip(f"{name}: {reason}")
    store, common = dist.HashStore(), dict(bucket_size=4096, timeout=20)
    sender = standalone_engine(name, 0, 2, store, device=f"{hal_device}:0", **common)  # its prepare() hosts the store

    def build_receiver():
        torch_device.set_device(1)  # as the rollout worker binds its rank's device before building the engine
        return standalone_engine(name, 1, 2, store, device=hal_device, **common)

    with concurrent.futures.ThreadPoolExecutor(1) as builder:
        receiver = builder.submit(build_receiver).result()
    assert (sender.device_kind, receiver.device_kind) == ("npu-sim:0", "npu-sim:1")
    weights = [(f"w{i}", torch.full((300,), float(i), device="npu:0")) for i in range(4)]

    def run(coro_fn):
        assert torch_device.current_device() == 0  # a fresh executor thread: not the receiver's device
        result = asyncio.run(coro_fn())
        return result, torch_device.current_device()

    async def receive():
        return [(n, t.device, t.cpu().clone()) async for n, t in receiver.receive_weights(1)]

    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            sent = pool.submit(run, lambda: sender.send_weights(weights, 1))
            got, receiver_thread_device = pool.submit(run, receive).result(timeout=60)
            sent.result(timeout=60)
    finally:
        _close(sender, receiver)
    assert [n for n, _, _ in got] == [f"w{i}" for i in range(4)]
    assert receiver_thread_device == 1
    assert all(t.unique().tolist() == [float(i)] for i, (_, _, t) in enumerate(got))
    devices = {d for _, d, _ in got}
    assert devices == {torch.device("npu", 1)} if name == "collective" else devices <= {torch.device("npu", 1),
                                                                                         torch.device("cpu")}
