"""Kimi's checkpoint-engine (``ckpt.kimi``) across processes: 1 trainer + 2 rollouts on each device kind it
runs on (npu-sim here; cuda and npu in the vendor lanes), skipped with the reason on the others. Its
in-process contract suite is in ``test_contract.py``; hal's refusal on cpu is tested there too."""

import asyncio

import pytest
import torch

import ckpt
import hal
from ckpt.testing import compare, sample_weights, transfer
from ckpt.testing import standalone_pair
from hal.apps.multiprocess import run_multiprocess
from tests.ckpt import mp_p2p_workers


@pytest.mark.multiprocess
def test_one_trainer_two_rollouts_steps_a_version_mismatch_and_a_killed_rollout(hal_device):
    """One process group, three updates: byte-exact with the sender's step; a rollout asking for another
    step gets a version error and nothing of that update; a rollout killed mid-update fails the trainer's
    send within the timeout naming it, and the other rollout's receive."""
    ok, reason = ckpt.checkpoint_engine_availability("kimi", hal_device)
    if not ok:
        pytest.skip(f"kimi on {hal_device}: {reason}")
    timeout = 15
    results = run_multiprocess(mp_p2p_workers.steps_mismatch_then_death, 3, "kimi", hal_device, timeout, timeout=150,
                               expect_failure=True)
    device_type = hal.get_device(hal_device).type  # npu-sim hands over npu tensors
    assert 2 not in results, results[2]  # rank 2 checked its steps 1 and 2 itself, then exited in step 3
    first, mismatch = results[1][:2]
    assert first == (1, "ok", 1, True, [device_type]), first
    assert mismatch == (2, "VersionMismatchError", 1, "version mismatch in rollout rank 1: asked for "
                        "global_steps=1, but the weights on offer carry global_steps=2"), mismatch
    assert results[0][:2] == [(1, "sent"), (2, "sent")]
    step, outcome, elapsed, text = results[0][2]
    assert step == 3 and outcome in ("TransferError", "TransferTimeoutError"), results[0][2]
    assert "rollout rank 2" in text and "step 3" in text, text
    # found by its heartbeat, long before the timeout (host registration of the update comes before the wait)
    assert elapsed < mp_p2p_workers.HEARTBEAT_TIMEOUT + 5, elapsed
    step, outcome, _, text, elapsed = results[1][2]  # the surviving rollout lost its broadcast peer
    assert step == 3 and outcome in ("TransferError", "TransferTimeoutError"), results[1][2]
    assert "rollout rank 1" in text and elapsed < timeout + 5, (text, elapsed)


def test_a_sender_whose_weights_raise_aborts_the_update_and_the_next_one_works(hal_device):
    ok, reason = ckpt.checkpoint_engine_availability("kimi", hal_device)
    if not ok:
        pytest.skip(f"kimi on {hal_device}: {reason}")

    async def main():
        sender, receiver = standalone_pair("kimi", bucket_size=64 << 10, device=hal_device, timeout=20)

        def failing():
            yield from sample_weights(1)[:3]
            raise ValueError("the trainer's iterator broke")

        async def receive():
            return [item async for item in receiver.receive_weights(7)]
        try:
            sent, got = await asyncio.gather(sender.send_weights(failing(), 7), receive(), return_exceptions=True)
            assert isinstance(sent, ValueError), sent
            assert isinstance(got, ckpt.TransferAbortedError) and "the trainer's iterator broke" in str(got), got
            assert receiver.received_global_steps is None  # nothing of step 7 was taken
            weights = sample_weights(8)
            compare(weights, await transfer(sender, receiver, weights, 8, 8), "the update after an abort")
            assert receiver.received_global_steps == 8
        finally:
            sender.close()
            receiver.close()
    asyncio.run(main())


def test_the_library_logs_no_info_inside_hal_unless_asked_and_stays_as_it_was_outside(hal_device, monkeypatch):
    """checkpoint-engine logs INFO through loguru on every registration and gather_metas: dropped while hal's
    engine calls it, kept with HAL_KIMI_LOGS=1, and a call of the library outside hal's engine logs as before."""
    ok, reason = ckpt.checkpoint_engine_availability("kimi", hal_device)
    if not ok:
        pytest.skip(f"kimi on {hal_device}: {reason}")
    from loguru import logger

    records = []
    sink = logger.add(lambda message: records.append(message.record), level="TRACE", filter="checkpoint_engine")

    def infos() -> list[str]:
        taken = [f"{r['name']}: {r['message']}" for r in records if r["level"].no <= logger.level("SUCCESS").no]
        records.clear()
        return taken

    async def main():
        sender, receiver = standalone_pair("kimi", bucket_size=64 << 10, device=hal_device, timeout=20)
        try:
            weights = sample_weights(1)[:4]
            monkeypatch.delenv("HAL_KIMI_LOGS", raising=False)
            compare(weights, await transfer(sender, receiver, weights, 1, 1), "a quiet update")
            assert infos() == []
            monkeypatch.setenv("HAL_KIMI_LOGS", "1")
            compare(weights, await transfer(sender, receiver, weights, 2, 2), "an update with the library's logs")
            loud = infos()
            for start in ("checkpoint_engine.ps: [rank0] gather parameter metas finished",
                          "checkpoint_engine.ps: [rank1] gather parameter metas finished",
                          "checkpoint_engine.pin_memory: [rank0] start to register"):
                assert any(line.startswith(start) for line in loud), (start, loud)
        finally:
            monkeypatch.delenv("HAL_KIMI_LOGS", raising=False)
            sender.close()
            receiver.close()
    try:
        asyncio.run(main())
        assert infos() == []  # closing (unregistering the pool and buffers) was quiet too
        from checkpoint_engine.pin_memory import _register_checkpoint

        assert _register_checkpoint(files=[], named_tensors={}, rank=5) == []  # outside hal: logs as always
        assert infos() == ["checkpoint_engine.pin_memory: [rank5] start to register checkpoint with 0 files and 0 "
                           "named_tensors"]
    finally:
        logger.remove(sink)


def test_the_library_backend_hal_installs_routes_only_calls_made_inside_a_hal_engine():
    """checkpoint-engine's collectives go to torch's default group; hal installs its own backend in the
    library's module global once, and calls from outside a hal engine still reach the library's own."""
    pytest.importorskip("checkpoint_engine.distributed", reason="checkpoint-engine is not installed (kimi extra)")
    from checkpoint_engine.distributed import base

    from ckpt.kimi_library import install_backend

    before = base._BACKEND_INSTANCE
    install_backend()
    install_backend()  # idempotent: one hal backend, wrapping the one installed before
    routed = base._BACKEND_INSTANCE
    assert routed.hal_routes and routed.previous is (before.previous if getattr(before, "hal_routes", False) else before)
    assert type(routed.previous).__name__ == "TorchBackend"
    assert base.is_initialized() is torch.distributed.is_initialized() is False  # answered by torch, not hal


@pytest.mark.multiprocess
@pytest.mark.hal_device("npu-sim", "cuda", "npu")
def test_rollouts_built_with_other_bucket_sizes_cut_the_trainers_buckets(hal_device):
    """Issue 20: with rollouts built for 4 KiB and 64 KiB buckets, each cut the update into its own buckets
    and their broadcast inside the rollout group disagreed. The trainer's bucket size travels with the
    update and every rollout cuts the same buckets."""
    ok, reason = ckpt.checkpoint_engine_availability("kimi", hal_device)
    if not ok:
        pytest.skip(f"kimi on {hal_device}: {reason}")
    from tests.ckpt import mp_workers

    results = run_multiprocess(mp_workers.bucket_size_mismatch, 3, "kimi", hal_device, (4096, 4096, 65536),
                               timeout=150)
    for rank in (1, 2):
        assert results[rank] == ("ok", [(f"w{i}", [float(i)]) for i in range(8)]), results[rank]


def test_a_failed_rollout_group_broadcast_makes_the_engine_unhealthy():
    """``hal soak`` found kimi never recovering from a rollout's stop: the rollout group's broadcast failed,
    yet the engine still said it was healthy, so ``prepare()`` offered the old group and every later update
    failed in it. A failed broadcast now breaks the group for good (a new one is formed next update)."""
    import types

    ok, reason = ckpt.checkpoint_engine_availability("kimi", "npu-sim")
    if not ok:
        pytest.skip(f"kimi on npu-sim: {reason}")
    from ckpt.errors import TransferTimeoutError
    from ckpt.kimi import KimiCheckpointEngine

    class BrokenGroup:
        def broadcast(self, tensor, src):
            raise hal.DistributedTimeoutError(f"broadcast from rank {src}: a peer is dead or missing")

        def close(self):
            pass

    class StubServer:  # the rollout's bucket is pulled by the other rollout (rank 2), then broadcast
        def buckets(self, metas, size, rollouts):
            return [(2, 0, types.SimpleNamespace(size=64))]

        def register_buffer(self, buffer):
            pass

        def unregister_buffer(self):
            pass

    engine = KimiCheckpointEngine(bucket_size=1024, device="npu-sim", rank=1, world_size=3,
                                  master_addr="127.0.0.1", master_port=1)
    engine._ps, engine._group, engine._in_place = StubServer(), BrokenGroup(), True
    engine._device = hal.get_device("npu-sim")
    assert engine.is_healthy()
    metas = {0: types.SimpleNamespace(memory_buffer_metas_list=[
        types.SimpleNamespace(metas=[types.SimpleNamespace(aligned_size=64)])])}

    async def pull():
        async for _ in engine._pull(metas, 1, 64):
            pass

    with pytest.raises(TransferTimeoutError, match="the rollout group's broadcast of bucket 0"):
        asyncio.run(pull())
    assert not engine.is_healthy()
    engine.close()
    engine._ps = StubServer()  # set up again: a new group is in step
    assert engine.is_healthy()


def test_a_group_joining_a_generation_its_store_served_again_reads_none_of_its_keys():
    """The trainer keeps its store across newer generations; a standalone engine that leaves and joins
    generation 0 again must not find the last group's keys there (a review found the send of a trainer with no
    rollout at all then returning at once, on the earlier update's metadata and done markers)."""
    ok, reason = ckpt.checkpoint_engine_availability("kimi", "npu-sim")
    if not ok:
        pytest.skip(f"kimi on npu-sim: {reason}")

    async def main():
        sender, receiver = standalone_pair("kimi", bucket_size=64 << 10, device="npu-sim", timeout=3)
        try:
            weights = sample_weights(1)[:4]
            compare(weights, await transfer(sender, receiver, weights, 1, 1), "the first update")
            for engine in (sender, receiver):
                engine.init_process_group(rank=-1)
            sender.init_process_group(rank=0, world_size=2, master_addr="127.0.0.1", master_port=sender.master_port)
            with pytest.raises(ckpt.TransferTimeoutError, match="rollout rank 1"):  # no rollout joined
                await sender.send_weights(iter(sample_weights(2)[:4]), 2)
        finally:
            sender.close()
            receiver.close()
    asyncio.run(main())
