"""The ipc checkpoint engine: the contract on every transport, then trainer and rollouts as separate processes
(byte-exact updates, a rollout or the trainer killed mid-update, a thousand updates without a leak)."""

import asyncio
import os

import pytest
import torch

import ckpt
import hal
from ckpt.ipc import default_endpoint, rollout_endpoint
from ckpt.testing import CONTRACT_CHECKS, run_check, sample_weights
from hal.apps.multiprocess import run_multiprocess
from tests.ckpt import ipc_workers

SIM_IPC_ENV = {"HAL_SIM_DRIVER_VERSION": "25.3.rc1", "HAL_SIM_CANN_VERSION": "8.3.RC1"}
"""What the simulated npu reports to pass verl's IPC gate (driver >= 25.3.rc1, CANN >= 8.3.RC1)."""

LANES = [("cpu", None), ("npu-sim", "shm"), ("npu-sim", "device")]
"""(device kind, transport) pairs every test runs on; ``None``: the kind's own (cpu: shm)."""


def _pair(device, transport, bucket_size=64 << 10):
    async def make():
        common = dict(world_size=2, endpoint=default_endpoint(), bucket_size=bucket_size, device=device, timeout=20,
                      transport=transport)
        return (ckpt.get_checkpoint_engine("ipc", rank=0, **common), ckpt.get_checkpoint_engine("ipc", rank=1, **common))
    return make


@pytest.mark.parametrize("check", list(CONTRACT_CHECKS))
@pytest.mark.parametrize("device, transport", LANES)
def test_ipc_engine_keeps_the_contract(device, transport, check):
    asyncio.run(run_check(_pair(device, transport), check, timeout=60))


def test_the_transport_is_the_device_kinds():
    assert ckpt.get_checkpoint_engine("ipc", device="cpu").transport == "shm"
    assert hal.resolve_device("cpu").ipc_transport() == "shm"
    with pytest.raises(ckpt.CheckpointConfigError, match="transport 'device' needs a device kind"):
        ckpt.get_checkpoint_engine("ipc", device="cpu", transport="device")
    with pytest.raises(ckpt.CheckpointConfigError, match="transport must be"):
        ckpt.get_checkpoint_engine("ipc", device="cpu", transport="nvlink")


@pytest.mark.parametrize("bad, match", [({"rank": 2, "world_size": 2, "endpoint": "ipc://@x"}, "rank must be"),
                                        ({"rank": 0, "world_size": 2, "endpoint": "/tmp/x"}, "endpoint must be"),
                                        ({"rank": 0, "world_size": 2, "endpoint": "ipc://@x", "peer_pids": [0]},
                                         "peer_pids"),
                                        ({"bucket_size": 0}, "bucket_size"), ({"timeout": float("nan")}, "timeout"),
                                        ({"bucket": 4096}, "unknown keyword")])
def test_bad_arguments_are_refused_by_name(bad, match):
    with pytest.raises(ckpt.CheckpointConfigError, match=match):
        ckpt.get_checkpoint_engine("ipc", device="cpu", **bad)


def test_send_without_a_place_and_on_the_wrong_side_is_refused():
    lonely = ckpt.get_checkpoint_engine("ipc", device="cpu")
    with pytest.raises(ckpt.CheckpointConfigError, match="no place yet"):
        asyncio.run(lonely.send_weights([], 1))
    rollout = ckpt.get_checkpoint_engine("ipc", device="cpu", rank=1, world_size=2, endpoint=default_endpoint())
    with pytest.raises(ckpt.CheckpointConfigError, match="trainer's"):
        asyncio.run(rollout.send_weights([], 1))


def test_build_topology_refuses_workers_on_two_hosts():
    meta = [{"pid": 1, "host": "a", "endpoint": "ipc://@e"}, {"pid": 2, "host": "b"}]
    with pytest.raises(ckpt.CheckpointConfigError, match="one host"):
        ckpt.checkpoint_engine_factory("ipc").build_topology(1, 1, meta)
    trainer, rollout = ckpt.checkpoint_engine_factory("ipc").build_topology(
        2, 2, [{"pid": 1, "host": "a", "endpoint": "ipc://@e"}, {"pid": 5, "host": "a"}, {"pid": 2, "host": "a"},
               {"pid": 3, "host": "a"}])
    assert trainer == {"rank": [0, -1], "world_size": [3, 3], "endpoint": ["ipc://@e"] * 2, "peer_pids": [[2, 3], None]}
    assert rollout == {"rank": [1, 2], "world_size": [3, 3], "endpoint": ["ipc://@e"] * 2, "peer_pids": [[1], [1]]}


def test_a_trainer_rank_outside_the_group_drains_its_iterator():
    engine = ckpt.get_checkpoint_engine("ipc", device="cpu", rank=-1, world_size=2, endpoint=default_endpoint())
    seen = []
    asyncio.run(engine.send_weights((seen.append(i) or (f"t{i}", torch.zeros(1)) for i in range(3)), 1))
    assert seen == [0, 1, 2]


def test_a_tensor_larger_than_the_bucket_lands_in_the_placement_target():
    big = torch.arange(10_000, dtype=torch.float32)  # 40 kB through buckets of 4 kB: ten slices
    target = torch.zeros_like(big)

    class Place:
        def target(self, name, dtype, shape):
            return target if name == "big" else None

    async def go():
        sender, receiver = await _pair("cpu", None, bucket_size=4096)()
        got = await asyncio.gather(sender.send_weights([("small", torch.ones(3)), ("big", big)], 1),
                                   _collect(receiver.receive_weights(1, placement=Place())))
        sender.close(), receiver.close()
        return got[1]
    (n1, small), (n2, out) = asyncio.run(go())
    assert (n1, n2) == ("small", "big") and torch.equal(small, torch.ones(3))
    assert out is target and torch.equal(target, big)


async def _collect(stream):
    return [(n, t.clone() if n != "big" else t) async for n, t in stream]


def test_a_failed_update_leaves_nothing_in_dev_shm_and_the_next_one_works():
    async def go():
        sender, receiver = await _pair("cpu", None, bucket_size=4096)()

        async def stop_early():
            async for _ in receiver.receive_weights(1):
                break
        results = await asyncio.gather(sender.send_weights(sample_weights(1), 1), stop_early(), return_exceptions=True)
        left = ipc_workers.segment_exists(receiver.segment_name)
        weights = sample_weights(2)
        again = await asyncio.gather(sender.send_weights(weights, 2), _collect(receiver.receive_weights(2)))
        name = sender.segment_name
        sender.close(), receiver.close()
        return results, left, again[1], weights, ipc_workers.segment_exists(name)
    (sent, _), left, got, weights, left_after_close = asyncio.run(go())
    assert isinstance(sent, ckpt.TransferError) and "rollout rank 1 refused" in str(sent), sent
    assert not left and not left_after_close
    assert ipc_workers.digest(got) == ipc_workers.digest(weights)


def test_process_alive_sees_a_dead_and_a_zombie_process():
    assert hal.process_alive(os.getpid())
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    import time

    time.sleep(0.2)  # exited, not yet reaped: a zombie
    assert not hal.process_alive(pid)
    os.waitpid(pid, 0)
    assert not hal.process_alive(pid)
    assert rollout_endpoint("ipc://@x", 2) == "ipc://@x-2"


def _env(device, transport):
    return SIM_IPC_ENV if (device, transport) == ("npu-sim", "device") else {}


@pytest.mark.multiprocess
@pytest.mark.parametrize("device, transport", LANES)
def test_two_rollout_processes_receive_every_update_byte_exact(device, transport):
    results = run_multiprocess(ipc_workers.updates, 3, device, 3, 8192, None, timeout=110, env=_env(device, transport))
    sent = results[0]["result"]
    expected_transport = transport or "shm"
    assert results[0]["transport"] == expected_transport  # the kind's own choice, from its reported versions
    for rank in (1, 2):
        assert [r["step"] for r in results[rank]["result"]] == [1, 2, 3]
        assert [r["digest"] for r in results[rank]["result"]] == sent
        kind_type = "cpu" if device == "cpu" else "npu"
        assert all(r["devices"] == [f"{kind_type}:{rank}"] if kind_type == "npu" else r["devices"] == ["cpu"]
                   for r in results[rank]["result"])
    assert results[0]["segment"] is not None and not results[0]["segment_left"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("device", ["cpu", "npu-sim"])
def test_a_rollout_killed_mid_update_fails_the_send_naming_it_and_leaves_no_segment(device):
    results = run_multiprocess(ipc_workers.rollout_dies, 3, device, timeout=110, expect_failure=True)
    trainer = results[0]
    assert 1 not in results  # it was killed
    assert trainer["error"] is not None and "rollout rank 1" in trainer["error"], trainer
    assert "died" in trainer["error"] and trainer["seconds"] < 10  # the liveness look, well inside timeout=60
    assert trainer["segment_was"] and not trainer["segment_left"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("device", ["cpu", "npu-sim"])
def test_a_trainer_killed_mid_update_leaves_the_rollout_serving_its_previous_step(device):
    results = run_multiprocess(ipc_workers.trainer_dies, 2, device, timeout=110, expect_failure=True)
    rollout = results[1]
    assert 0 not in results
    assert rollout["error"] is not None and "the trainer" in rollout["error"] and "died" in rollout["error"], rollout
    assert rollout["seconds"] < 10
    assert rollout["served_step"] == 1 and rollout["served"] == ipc_workers.digest(sample_weights(1))
    assert not rollout["segment_left"]  # the trainer's resource tracker unlinked it


@pytest.mark.multiprocess
@pytest.mark.parametrize("device, transport", LANES)
def test_an_update_staged_in_a_transient_publish_buffer_is_read_in_place_within_a_bucket_of_memory(device,
                                                                                                   transport):
    bucket = 1 << 20
    results = run_multiprocess(ipc_workers.in_place_updates, 3, device, 3, bucket, True, 48, timeout=110,
                               env=_env(device, transport))
    trainer = results[0]
    assert not trainer["bucket_buffer"]  # nothing copied: the two buckets were never allocated
    assert len(set(trainer["segments"])) == 3  # freed at each finalize, a new one each update
    for rank in (1, 2):
        rollout = results[rank]
        assert rollout["steps"] == [1, 2, 3, 5]  # step 4 was refused
        assert rollout["digests"] == trainer["digests"]  # in place (1-3) and through the buckets (5)
        # 24 MiB of blocks read in place: the rollout's resident memory grew by about a bucket, not by the update
        assert all(g < 4 * bucket for g in rollout["growth"][1:]), rollout["growth"]  # the first opens sockets
        assert len(rollout["errors"]) == 1 and "TransferAbortedError" in rollout["errors"][0], rollout["errors"]
    assert len(trainer["errors"]) == 1 and "'stray' is not a contiguous view" in trainer["errors"][0], trainer
    assert not trainer["segment_left"]


@pytest.mark.multiprocess
def test_a_kept_publish_buffer_is_one_segment_across_updates_and_read_in_place_byte_exact():
    results = run_multiprocess(ipc_workers.in_place_updates, 2, "cpu", 3, 1 << 20, False, 8, timeout=110)
    trainer, rollout = results[0], results[1]
    assert not trainer["bucket_buffer"] and len(set(trainer["segments"])) == 1
    assert rollout["steps"] == [1, 2, 3, 5] and rollout["digests"] == trainer["digests"]
    assert not trainer["segment_left"]


def test_a_publish_buffer_is_the_engines_own_and_refused_out_of_place():
    trainer = ckpt.get_checkpoint_engine("ipc", rank=0, world_size=2, endpoint=default_endpoint(), device="cpu")
    buffer = trainer.publish_buffer(4096, "cpu")
    assert buffer.dtype == torch.uint8 and buffer.numel() == 4096
    assert trainer.publish_buffer(4096) is buffer  # the same size: the same buffer
    segment = trainer._publish.segment
    assert os.path.exists(f"/dev/shm/{segment}")
    with pytest.raises(ckpt.CheckpointConfigError, match="positive int of bytes, got 0"):
        trainer.publish_buffer(0)
    rollout = ckpt.get_checkpoint_engine("ipc", rank=1, world_size=2, endpoint=default_endpoint(), device="cpu")
    with pytest.raises(ckpt.CheckpointConfigError, match="publish_buffer is the trainer's"):
        rollout.publish_buffer(4096)
    trainer.close()
    assert not os.path.exists(f"/dev/shm/{segment}")


def test_the_base_publish_buffer_is_plain_memory_any_engine_sends():
    engine = ckpt.get_checkpoint_engine("colocated")
    buffer = engine.publish_buffer(64, "cpu")
    assert buffer.dtype == torch.uint8 and buffer.shape == (64,)
    engine.release_publish_buffer()  # nothing to free: a no-op
    with pytest.raises(ckpt.CheckpointConfigError, match="got -1"):
        engine.publish_buffer(-1, "cpu")


@pytest.mark.multiprocess
def test_a_thousand_updates_leave_fds_segments_and_memory_flat():
    results = run_multiprocess(ipc_workers.many_updates, 2, "cpu", 1000, 16 << 10, timeout=110)
    for rank, r in results.items():
        early, late = r["samples"][10], r["samples"][1000]
        assert late["fds"] <= early["fds"], (rank, r)
        assert late["threads"] == early["threads"], (rank, r)
        assert late["segment"] == early["segment"]  # one buffer for the whole topology
        assert late["rss"] - early["rss"] < 16 << 10 + (4 << 20), (rank, r)  # under one bucket (+ allocator slack)
        assert not r["segment_left"]


def test_weights_that_fail_mid_update_abort_the_rollout_at_once_and_the_next_update_works():
    def failing():
        yield from sample_weights(1)[:3]
        raise RuntimeError("the trainer's generator broke")

    async def go():
        sender, receiver = await _pair("cpu", None, bucket_size=4096)()
        sender.timeout = receiver.timeout = 60.0  # an abort must not wait for the timeout
        loop = asyncio.get_running_loop()
        start = loop.time()
        results = await asyncio.gather(sender.send_weights(failing(), 1), _collect(receiver.receive_weights(1)),
                                       return_exceptions=True)
        seconds = loop.time() - start
        weights = sample_weights(2)
        again = await asyncio.gather(sender.send_weights(weights, 2), _collect(receiver.receive_weights(2)))
        sender.close(), receiver.close()
        return results, seconds, again[1], weights
    (sent, got), seconds, again, weights = asyncio.run(go())
    assert isinstance(sent, RuntimeError) and "generator broke" in str(sent)
    assert isinstance(got, ckpt.TransferAbortedError) and "generator broke" in str(got), got
    assert seconds < 10
    assert ipc_workers.digest(again) == ipc_workers.digest(weights)


def test_a_rollout_that_refuses_an_update_ends_it_for_every_rollout_at_once():
    """Before, the trainer raised at the first refusal and told the other rollouts nothing: each waited out its
    timeout for a bucket that never came, and a refusal behind the first was left unread on its socket."""
    async def go():
        common = dict(world_size=3, endpoint=default_endpoint(), bucket_size=256, device="cpu", timeout=60)
        sender, refuses, told = (ckpt.get_checkpoint_engine("ipc", rank=r, **common) for r in range(3))
        loop = asyncio.get_running_loop()
        start = loop.time()
        results = await asyncio.gather(sender.send_weights(sample_weights(1), 1),
                                       _collect(refuses.receive_weights(2)), _collect(told.receive_weights(1)),
                                       return_exceptions=True)
        seconds = loop.time() - start
        weights = sample_weights(2)
        again = await asyncio.gather(sender.send_weights(weights, 2), _collect(refuses.receive_weights(2)),
                                     _collect(told.receive_weights(2)))
        for engine in (sender, refuses, told):
            engine.close()
        return results, seconds, again[1:], weights
    (sent, refused, aborted), seconds, again, weights = asyncio.run(go())
    assert isinstance(sent, ckpt.TransferError) and "rollout rank 1 refused the update of global_steps=1" in str(sent)
    assert isinstance(refused, ckpt.VersionMismatchError), refused
    assert isinstance(aborted, ckpt.TransferAbortedError) and "rollout rank 1 refused" in str(aborted), aborted
    assert seconds < 10, seconds  # told at once, not after its 60 s timeout
    assert [ipc_workers.digest(got) for got in again] == [ipc_workers.digest(weights)] * 2


def test_a_consumer_that_stops_after_the_last_item_completes_the_update():
    # verl's delta reader (ckpt.delta.transport) stops at the flush marked last, without asking past it
    weights = sample_weights(3)

    async def go():
        sender, receiver = await _pair("cpu", None, bucket_size=4096)()
        got = []

        async def up_to_the_last():
            async for name, t in receiver.receive_weights(3):
                got.append((name, t.clone()))
                if len(got) == len(weights):
                    break
        await asyncio.gather(sender.send_weights(weights, 3), up_to_the_last())
        sender.close(), receiver.close()
        return got
    assert ipc_workers.digest(asyncio.run(go())) == ipc_workers.digest(weights)
