"""The ipc checkpoint engine: the contract on every transport, then trainer and rollouts as separate processes
(byte-exact updates, a rollout or the trainer killed mid-update, a thousand updates without a leak)."""

import asyncio
import os

import pytest
import torch

import ckpt
import hal
from ckpt.ipc import ForeignTrainerError, default_endpoint, rollout_endpoint
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


def test_finalize_frees_the_buffers_but_keeps_the_sockets():
    """Issue 50: with release_at_finalize (how the job builds every worker) finalize() closed both sides' sockets,
    and the next update's first message could land on the rollout's old, still-closing socket (both sides then
    timed out). The buffers go every update; the sockets stay."""
    async def go():
        common = dict(world_size=2, endpoint=default_endpoint(), bucket_size=4096, device="cpu", timeout=20,
                      release_at_finalize=True)
        sender, receiver = (ckpt.get_checkpoint_engine("ipc", rank=r, **common) for r in (0, 1))
        seen = []
        for step in (1, 2, 3):
            weights = sample_weights(step)
            got = await asyncio.gather(sender.send_weights(weights, step), _collect(receiver.receive_weights(step)))
            assert ipc_workers.digest(got[1]) == ipc_workers.digest(weights)
            segment = sender.segment_name
            sender.finalize(), receiver.finalize()
            seen.append((sender._peers[0].sock, receiver._rep, segment, ipc_workers.segment_exists(segment)))
        sender.close(), receiver.close()
        return seen
    seen = asyncio.run(go())
    assert len({id(s[0]) for s in seen}) == 1 and len({id(s[1]) for s in seen}) == 1  # one socket each, kept
    assert len({s[2] for s in seen}) == 3 and not any(s[3] for s in seen)  # a new buffer each update, freed


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("device, transport", LANES)
def test_back_to_back_updates_that_free_their_buffers_lose_none(device, transport):
    """2,000 updates (HAL_IPC_UPDATES) with release_at_finalize, the rollout working 0-10 ms on each before its
    finalize() (about 20 s a lane): before the fix an update was lost within the first 20 on every lane."""
    updates = int(os.environ.get("HAL_IPC_UPDATES", "2000"))
    results = run_multiprocess(ipc_workers.back_to_back, 2, device, transport, updates, 10.0,
                               timeout=60 + updates // 20, env=_env(device, transport))
    for rank in (0, 1):
        assert results[rank]["errors"] == [] and results[rank]["good"] == updates, (rank, results[rank]["errors"][:3])


def test_a_rollout_refuses_a_trainer_of_another_job_and_the_trainer_says_why():
    async def go():
        common = dict(world_size=2, endpoint=default_endpoint(), bucket_size=4096, device="cpu", timeout=20)
        sender = ckpt.get_checkpoint_engine("ipc", rank=0, job="job-a", **common)
        receiver = ckpt.get_checkpoint_engine("ipc", rank=1, job="job-b", **common)
        got = await asyncio.gather(sender.send_weights(sample_weights(1), 1), _collect(receiver.receive_weights(1)),
                                   return_exceptions=True)
        sender.close(), receiver.close()
        return got
    sent, received = asyncio.run(go())
    assert isinstance(received, ForeignTrainerError), received
    assert "is job 'job-a'" in str(received) and "built for job 'job-b'" in str(received)
    assert isinstance(sent, ckpt.TransferError) and "rollout rank 1 refused the update of global_steps=1: " \
        "ForeignTrainerError: the trainer at" in str(sent), sent


def test_the_lifecycle_pins_each_rollout_to_its_trainers_job_and_generation():
    """build_topology hands the master's job and a generation to every rank (one higher when the topology or a
    rollout's trainer changed); a rollout then refuses another generation of its own job."""
    from ckpt.testing import finalize_both, transfer, verl_lifecycle

    async def go():
        common = dict(bucket_size=4096, device="cpu", timeout=20)
        sender = ckpt.get_checkpoint_engine("ipc", is_master=True, job="ppo", **common)
        receiver = ckpt.get_checkpoint_engine("ipc", **common)
        generations = []
        for step in (1, 2):
            await verl_lifecycle(sender, receiver)
            generations.append((sender.identity["generation"], dict(receiver._pin)))
            await transfer(sender, receiver, sample_weights(step), step, step)
            await finalize_both(sender, receiver)
        sender.generation += 1  # as a trainer of a later topology of the same job
        try:
            await transfer(sender, receiver, sample_weights(3), 3, 3)
        except Exception as exc:  # noqa: BLE001 - read below
            refused = exc
        sender.close(), receiver.close()
        return generations, refused
    generations, refused = asyncio.run(go())
    assert generations == [(1, {"job": "ppo", "generation": 1})] * 2  # formed once, kept while unchanged
    assert isinstance(refused, ForeignTrainerError) and "generation 2" in str(refused) and \
        "built for job 'ppo', generation 1" in str(refused), refused


def test_a_second_trainer_on_an_endpoint_in_use_fails_at_once_naming_it():
    """Before, a second trainer's bind retried for 5 s and took the endpoint over whenever the first one closed its
    socket (every finalize with release_at_finalize)."""
    async def go():
        endpoint = default_endpoint()
        common = dict(world_size=2, endpoint=endpoint, bucket_size=4096, device="cpu", timeout=20)
        first, rollout, second = (ckpt.get_checkpoint_engine("ipc", rank=r, **common) for r in (0, 1, 0))
        await asyncio.gather(first.send_weights(sample_weights(1), 1), _collect(rollout.receive_weights(1)))
        first.finalize()
        start = asyncio.get_running_loop().time()
        try:
            await second.send_weights(sample_weights(1), 1)
        except Exception as exc:  # noqa: BLE001 - read below
            error = exc
        seconds = asyncio.get_running_loop().time() - start
        again = await asyncio.gather(first.send_weights(sample_weights(2), 2), _collect(rollout.receive_weights(2)))
        for engine in (first, rollout, second):
            engine.close()
        return endpoint, error, seconds, again[1]
    endpoint, error, seconds, again = asyncio.run(go())
    assert isinstance(error, ckpt.CheckpointConfigError), error
    assert f"the ipc endpoint {endpoint}-1 is in use by another process" in str(error) and seconds < 1, seconds
    assert ipc_workers.digest(again) == ipc_workers.digest(sample_weights(2))  # the first job goes on


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["lifecycle", "job"])
def test_two_jobs_on_one_explicit_endpoint_never_take_each_others_updates(how):
    """Issue 50 (verl 6233, 6246): two jobs given one endpoint; before, some rollouts applied the other job's weights
    with no error on either side. Now the second trainer fails at once naming the endpoint, and a rollout refuses
    the other job's trainer: 0 updates cross in 20 tries."""
    results = run_multiprocess(ipc_workers.two_jobs, 4, how, 20, 2.0, timeout=110)
    a_trainer, a_rollout, b_trainer, b_rollout = (results[r] for r in range(4))
    assert a_rollout["received"] == {"A": a_trainer["sent"], "B": 0} and a_trainer["sent"] >= 1
    assert b_rollout["received"] == {"A": 0, "B": 0} and b_trainer["sent"] == 0
    assert len(b_trainer["errors"]) == 20 and all("CheckpointConfigError: the ipc endpoint ipc://" in e and
                                                  "-1 is in use by another process" in e for e in b_trainer["errors"])
    assert max(b_trainer["seconds"]) < 1, b_trainer["seconds"]
    refusals = [e for e in b_rollout["errors"] if e.startswith("ForeignTrainerError")]
    assert refusals and all("but this rollout was built for job" in e for e in refusals)
    assert all(e.startswith(("ForeignTrainerError", "TransferTimeoutError", "PeerFailure")) for e in b_rollout["errors"])
    for e in a_trainer["errors"]:  # its messages that reached the other job's rollout were refused, naming why
        assert "ForeignTrainerError" in e or "TransferTimeoutError" in e, e


def test_three_sends_at_once_refuse_the_later_two_naming_the_step_and_the_first_and_next_arrive():
    """Issue 50: three concurrent send_weights on one ipc engine gave a CancelledError, 'Socket operation on
    non-socket' and a rollout told 'the trainer sent dict', and the lone update after them was refused too."""
    async def go():
        sender, receiver = await _pair("cpu", None, bucket_size=4096)()
        got = await asyncio.gather(sender.send_weights(sample_weights(1), 1), sender.send_weights(sample_weights(2), 2),
                                   sender.send_weights(sample_weights(3), 3), _collect(receiver.receive_weights(1)),
                                   return_exceptions=True)
        again = await asyncio.gather(sender.send_weights(sample_weights(4), 4), _collect(receiver.receive_weights(4)))
        sender.close(), receiver.close()
        return got, again[1]
    (first, second, third, received), again = asyncio.run(go())
    assert first is None and ipc_workers.digest(received) == ipc_workers.digest(sample_weights(1))
    for refused, step in ((second, 2), (third, 3)):
        assert isinstance(refused, ckpt.SendInProgressError), refused
        assert f"send_weights(global_steps={step}) refused" in str(refused) and "sending global_steps=1" in str(refused)
    assert ipc_workers.digest(again) == ipc_workers.digest(sample_weights(4))


def test_an_error_the_rollout_throws_into_the_stream_reaches_the_trainer_with_its_cause():
    """Before, the trainer heard 'the receiver stopped before the end of the update', without the cause."""
    async def go():
        sender, receiver = await _pair("cpu", None, bucket_size=4096)()
        sender.timeout = receiver.timeout = 60.0

        async def refuse():
            stream = receiver.receive_weights(1)
            async for name, _ in stream:
                if name == "int64.ids":
                    await stream.athrow(ckpt.WeightMismatchError("tensor 'int64.ids': received int64, serves int32"))
        got = await asyncio.gather(sender.send_weights(sample_weights(1), 1), refuse(), return_exceptions=True)
        again = await asyncio.gather(sender.send_weights(sample_weights(2), 2), _collect(receiver.receive_weights(2)))
        sender.close(), receiver.close()
        return got, again[1]
    (sent, refused), again = asyncio.run(go())
    assert isinstance(refused, ckpt.WeightMismatchError)  # athrow raises it back to the consumer
    assert isinstance(sent, ckpt.TransferError) and str(sent) == (
        "rollout rank 1 refused the update of global_steps=1: WeightMismatchError: tensor 'int64.ids': received "
        "int64, serves int32"), sent
    assert ipc_workers.digest(again) == ipc_workers.digest(sample_weights(2))


@pytest.mark.multiprocess
def test_a_device_handle_goes_only_to_a_rollout_that_can_open_it_and_a_cpu_rollout_gets_shared_memory():
    """Issue 50: an npu-sim trainer above the IPC gate sent its device handle to a cpu rollout, which failed in torch
    ("Please register PrivateUse1HooksInterface"). The cpu rollout's hello says it opens shared memory only; the
    trainer serves it a shared-memory copy of each bucket, the npu-sim rollout the device buffer in place."""
    results = run_multiprocess(ipc_workers.mixed_kinds, 3, ("npu-sim", "cpu", "npu-sim"), 3, timeout=110,
                               env=SIM_IPC_ENV)
    trainer = results[0]
    assert trainer["transport"] == "device" and trainer["served"] == ["shm", "device"]
    assert len(trainer["segments"]) == 2 and not trainer["segments_left"]
    cpu, npu = results[1], results[2]
    assert cpu["backend"] == "privateuseone"  # the simulated npu was never registered there
    assert [r["digest"] for r in cpu["received"]] == [r["digest"] for r in npu["received"]] == trainer["sent"]
    assert all(r["devices"] == ["cpu"] for r in cpu["received"])
    assert all(r["devices"] == ["npu:2"] for r in npu["received"])


def test_a_rollout_that_timed_out_mid_update_refuses_its_rest_and_takes_the_next_on_the_same_socket():
    """The rollout keeps its socket after a timeout too: the bucket the trainer sends late reaches the rollout's next
    receive_weights, which refuses it (the trainer's update fails at once) and goes on to the next update."""
    import time

    def slow():
        for i, item in enumerate(sample_weights(1)):
            if i == 10:
                time.sleep(0.6)  # the trainer stalls mid-update, past the rollout's timeout
            yield item

    async def trainer(sender):  # in its own thread and event loop, as a trainer process would be
        outcomes = []
        for weights, step in ((slow(), 1), (sample_weights(2), 2)):
            start = time.monotonic()
            try:
                await sender.send_weights(weights, step)
                outcomes.append((None, time.monotonic() - start))
            except ckpt.TransferError as exc:
                outcomes.append((exc, time.monotonic() - start))
        return outcomes

    async def go():
        sender, receiver = await _pair("cpu", None, bucket_size=4096)()
        receiver.timeout = 0.2
        sent = asyncio.ensure_future(asyncio.to_thread(asyncio.run, trainer(sender)))
        with pytest.raises(ckpt.TransferTimeoutError, match="no bucket within 0.2 s"):
            await _collect(receiver.receive_weights(1))
        receiver.timeout = 20.0
        sock = receiver._rep
        received = await _collect(receiver.receive_weights(2))
        outcomes = await sent
        kept = receiver._rep is sock
        sender.close(), receiver.close()
        return outcomes, received, kept
    ((late, late_s), (second, _)), received, kept = asyncio.run(go())
    assert isinstance(late, ckpt.TransferError) and "TransferError: this rollout left that update" in str(late), late
    assert late_s < 5 and second is None and kept
    assert ipc_workers.digest(received) == ipc_workers.digest(sample_weights(2))


def test_an_update_the_trainer_gave_up_before_the_rollout_read_it_does_not_fail_the_next():
    """The trainer's first message of an update it abandoned (no rollout read it within its timeout) waits in the
    rollout's kept socket, its buffer freed: the rollout answers it (the trainer drops that late reply) and takes
    the next update."""
    async def go():
        sender, receiver = await _pair("cpu", None, bucket_size=4096)()
        await asyncio.gather(sender.send_weights(sample_weights(0), 0), _collect(receiver.receive_weights(0)))
        sender.timeout = 0.3
        with pytest.raises(ckpt.TransferTimeoutError, match="no reply to the buffer's handle within 0.3 s"):
            await sender.send_weights(sample_weights(1), 1)
        sender.timeout = 20.0
        got = await asyncio.gather(sender.send_weights(sample_weights(2), 2), _collect(receiver.receive_weights(2)))
        sender.close(), receiver.close()
        return got[1]
    assert ipc_workers.digest(asyncio.run(go())) == ipc_workers.digest(sample_weights(2))
