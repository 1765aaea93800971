"""verl 0.9.1's own same-host hand-over (``BucketedWeightSender`` / ``BucketedWeightReceiver``, shared-memory mode,
as verl runs it on Ascend stacks without IPC) against hal's ipc engine, both ways, in separate processes on the
simulated npu: byte-exact, so either side of a hybrid engine can be verl's."""

import importlib.util

import pytest

import hal
from hal.apps.multiprocess import run_multiprocess
from tests.interop import verl_ipc_workers

pytestmark = [
    pytest.mark.interop, pytest.mark.multiprocess,
    pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl is not installed (the verl extra)"),
    pytest.mark.skipif(not hal.availability("npu-sim"), reason="npu-sim unavailable"),
]


@pytest.mark.parametrize("bucket_size", [820_000, 4 << 20])
def test_verls_receiver_takes_what_hals_sender_sends(bucket_size):
    results = run_multiprocess(verl_ipc_workers.hal_sends_verl_receives, 2, bucket_size, timeout=110)
    trainer, rollout = results[0], results[1]
    assert trainer["transport"] == "shm"  # the sim reports CANN 8.2.RC1: below the IPC gate, as verl sees it
    assert [r["digest"] for r in rollout] == trainer["sent"]
    for r in rollout:
        assert r["lasts"][-1] is True and not any(r["lasts"][:-1])
        assert r["devices"] == ["npu:1"]  # verl's receiver copied each tensor to its own device
    if bucket_size == 820_000:  # lm_head (800 kB) does not fit beside the rest (40 kB): two buckets
        assert all(len(r["lasts"]) == 2 for r in rollout)
    assert not trainer["segment_left"]


def test_hals_receiver_takes_what_verls_sender_sends():
    results = run_multiprocess(verl_ipc_workers.verl_sends_hal_receives, 2, timeout=110)
    trainer, rollout = results[0], results[1]
    assert [r["digest"] for r in rollout] == trainer["sent"]
    assert all(r["step"] is None for r in rollout)  # verl's sender carries no step
    assert all(r["devices"] == ["npu:1"] for r in rollout)
