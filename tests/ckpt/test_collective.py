"""CollectiveCheckpointEngine in one process (two ranks on threads of one event loop) and its bucket plan."""

import asyncio

import pytest
import torch

import ckpt
import hal
from ckpt.bucket import plan_messages
from ckpt.testing import compare, sample_weights, standalone_pair, transfer
from ckpt.wire import Segment, WireMessage
from tests.ports import held_port


def _pair(bucket_size, direct_threshold=None, **extra):
    return standalone_pair("collective", bucket_size=bucket_size, device="cpu", timeout=20,
                           direct_threshold=direct_threshold, **extra)


def _flat_views():
    """Tensors of several dtypes laid back to back in one storage (as a flat parameter buffer), one gap."""
    flat = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    layout = [("f32", torch.float32, (10,), 0), ("bf16", torch.bfloat16, (3, 4), 40), ("i64", torch.int64, (7,), 64),
              ("bool", torch.bool, (6,), 120), ("f16", torch.float16, (9,), 126),
              ("after_gap", torch.float32, (300,), 160 + 64), ("tail", torch.bfloat16, (700,), 1424)]
    flat[120:126] %= 2  # valid bool bytes
    return [(n, flat[o:o + torch.empty(s, dtype=d).nbytes].view(d).view(s)) for n, d, s, o in layout], flat


def test_adjacent_views_are_sent_from_their_storage_as_one_segment():
    weights, flat = _flat_views()
    msgs = list(plan_messages(weights[:5], 1, 1 << 20, 64 << 10, torch.device("cpu"), direct_threshold=16))
    bucket, end = msgs
    assert end.meta == WireMessage(step=1, bucket_size=1 << 20, end=True)
    assert bucket.meta.segments == [Segment(bucket.meta.entries[0].offset, 144)]  # 0..144: five tensors, one range
    assert bucket.sources[0].data_ptr() == flat.data_ptr() and bucket.buffer is None  # zero copy
    offsets = [e.offset for e in bucket.meta.entries]
    assert [o - offsets[0] for o in offsets] == [0, 40, 64, 120, 126]  # same relative layout as the sender


@pytest.mark.parametrize("bucket_size, threshold", [(1 << 20, 16), (512, 16), (512, 0), (2048, 1 << 20)])
def test_flat_views_round_trip_byte_exact(bucket_size, threshold):
    weights, _ = _flat_views()
    sender, receiver = _pair(bucket_size, threshold)

    async def go():
        try:
            got = await transfer(sender, receiver, weights, 5, 5)
            compare(weights, got, "flat views")
            compare(sample_weights(6), await transfer(sender, receiver, sample_weights(6), 6, None), "then separate")
        finally:
            sender.close(), receiver.close()
    asyncio.run(go())


def test_lifecycle_runs_lazily_and_the_group_is_kept_across_updates():
    sender, receiver = _pair(4096)

    async def go():
        groups = []
        for step in (1, 2, 3):
            compare(sample_weights(step), await transfer(sender, receiver, sample_weights(step), step, step), "step")
            groups.append((id(sender._group), id(receiver._group)))
        topo = receiver.topology
        sender.close(), receiver.close()
        return groups, topo
    groups, topo = asyncio.run(go())
    assert len(set(groups)) == 1  # one communicator for all three updates
    assert topo == {"rank": 1, "world_size": 2, "src_rank": 0, "role": "receiver", "receivers": [1]}


def test_wrong_role_and_bad_config_raise_clear_errors():
    sender, receiver = _pair(4096)

    async def wrong_role():
        with pytest.raises(ckpt.CheckpointConfigError, match="send_weights called on rank 1, but src_rank is 0"):
            await receiver.send_weights([], 1)
        with pytest.raises(ckpt.CheckpointConfigError, match="receive_weights called on rank 0"):
            async for _ in sender.receive_weights(1):
                pass
    asyncio.run(wrong_role())
    with pytest.raises(ckpt.CheckpointConfigError, match="rank must be an int in \\[0, 2\\), got 2"):
        ckpt.get_checkpoint_engine("collective", rank=2, world_size=2, store_addr="127.0.0.1:1")
    with pytest.raises(ckpt.CheckpointConfigError, match="store_addr must be 'host:port', got 'nohost'"):
        ckpt.get_checkpoint_engine("collective", rank=0, world_size=2, store_addr="nohost")
    with pytest.raises(ckpt.CheckpointConfigError, match="bucket_size must be an int >= 1, got 0"):
        ckpt.get_checkpoint_engine("collective", rank=0, world_size=2, store_addr="h:1", bucket_size=0)
    for kind in ("collective", "nixl", "mooncake"):  # the transfer-library engines build without their library
        for bad in (-1, 1.5, "7", True):
            with pytest.raises(ckpt.CheckpointConfigError, match=f"direct_threshold must be .* >= 0 bytes, got {bad!r}"):
                ckpt.get_checkpoint_engine(kind, rank=0, world_size=2, store_addr="h:1", direct_threshold=bad)


def test_a_consumer_that_stops_early_leaves_the_group_in_step():
    sender, receiver = _pair(1024)

    async def go():
        async def partial():
            stream = receiver.receive_weights(1)
            async for _name, _t in stream:
                break
            await stream.aclose()  # drains the rest of step 1
        await asyncio.gather(sender.send_weights(iter(sample_weights(1)), 1), partial())
        got = await transfer(sender, receiver, sample_weights(2), 2, 2)
        sender.close(), receiver.close()
        return got
    compare(sample_weights(2), asyncio.run(go()), "after an abandoned update")


def test_a_standalone_sender_without_a_port_hosts_its_store_where_the_kernel_put_it():
    sender = ckpt.get_checkpoint_engine("collective", rank=0, world_size=2, master_addr="127.0.0.1", device="cpu",
                                        timeout=5)
    try:
        port = sender.prepare()["master_port"]
        assert port > 0 and sender.master_port == port and sender.prepare()["master_port"] == port  # hosted once
        client = hal.connect_store("127.0.0.1", port, 1, 2, timeout=2, is_master=False)  # served already
        client.set("probe", "1")
    finally:
        sender.close()
    for rank, src_rank in ((1, 0), (1, 1)):  # a receiver, or a sender that is not rank 0 (rank 0 hosts the store)
        with pytest.raises(ckpt.CheckpointConfigError, match="except on rank 0 sending, master_port"):
            ckpt.get_checkpoint_engine("collective", rank=rank, world_size=2, master_addr="127.0.0.1", device="cpu",
                                       src_rank=src_rank)
    receiver = ckpt.get_checkpoint_engine("collective", device="cpu", timeout=5)
    try:  # verl's lifecycle, no port: refused at once, not after waiting on a store it hosted itself
        with pytest.raises(ckpt.CheckpointConfigError, match="rank 1 of the collective group needs the master_port"):
            receiver.init_process_group(rank=1, world_size=2, master_addr="127.0.0.1")
    finally:
        receiver.close()


def test_a_receiver_alone_times_out_with_a_clear_error():
    engine = ckpt.get_checkpoint_engine("collective", rank=0, world_size=2, master_addr="127.0.0.1",
                                        timeout=1.5, device="cpu")  # its store on a port the kernel picks
    with pytest.raises(ckpt.TransferTimeoutError, match="could not form the checkpoint group"):
        asyncio.run(engine.send_weights([], 1))


def test_a_sender_whose_weights_fail_mid_update_aborts_it_and_the_group_stays_usable():
    sender, receiver = _pair(1024)

    def failing():
        for i, item in enumerate(sample_weights(1)):
            if i == 7:
                raise RuntimeError("gather of layer 7 failed")
            yield item

    async def go():
        adapter = ckpt.InMemoryRolloutAdapter()
        worker = ckpt.CheckpointEngineWorker(receiver, adapter)
        sent, got = await asyncio.gather(sender.send_weights(failing(), 1), worker.update_weights(1),
                                         return_exceptions=True)
        assert isinstance(sent, RuntimeError) and "layer 7" in str(sent)
        assert isinstance(got, ckpt.TransferAbortedError) and "gather of layer 7 failed" in str(got)
        assert adapter.served_step is None and adapter.state_dict() == {}
        compare(sample_weights(2), await transfer(sender, receiver, sample_weights(2), 2, 2), "after the abort")
        sender.close(), receiver.close()
    asyncio.run(go())


@pytest.mark.hal_device("npu-sim")
@pytest.mark.parametrize("final_wait", ["kept", "dropped"])
def test_the_sender_may_reuse_its_tensors_only_because_send_weights_waits(hal_device, final_wait, monkeypatch):
    """On npu-sim a collective runs only when waited on (as HCCL's completes later): a send_weights that
    returned before waiting on its last broadcasts fails the contract's sender-reuse check (its receiver
    times out: nothing of those broadcasts ran), while the engine as it is passes it."""
    from ckpt.collective import CollectiveCheckpointEngine
    from ckpt.testing import ContractFailure, run_check

    if final_wait == "dropped":
        wait = CollectiveCheckpointEngine._wait

        async def without_final_wait(self, works, what):
            if not what.startswith("end of step"):
                await wait(self, works, what)
        monkeypatch.setattr(CollectiveCheckpointEngine, "_wait", without_final_wait)

    async def make():
        return standalone_pair("collective", (f"{hal_device}:0", f"{hal_device}:1"), bucket_size=64 << 10,
                               timeout=3, direct_threshold=256)

    check = run_check(make, "sender_may_reuse", timeout=60)
    if final_wait == "kept":
        asyncio.run(check)
    else:
        with pytest.raises((ckpt.TransferTimeoutError, ContractFailure)):
            asyncio.run(check)


class _Bank:
    """A ReceivePlacement: every tensor has a home in one flat bank, laid out as the rollout lays it out."""

    def __init__(self, weights):
        self.layout = ckpt.WeightLayout(weights)
        self.bank = self.layout.allocate("cpu")
        self.asked = []

    def target(self, name, dtype, shape):
        self.asked.append((name, dtype, tuple(shape)))
        return self.layout.view(self.bank, name)


def test_receive_writes_into_a_receive_placements_targets():
    weights = [(f"w{i}", torch.full((64,), float(i))) for i in range(4)]
    flat = torch.cat([t for _, t in weights])  # the sender publishes them back to back: one run
    published = [(n, flat[64 * i:64 * (i + 1)]) for i, (n, _) in enumerate(weights)]
    sender, receiver = _pair(1 << 16, direct_threshold=64)
    placement = _Bank(weights)

    async def run():
        got = await asyncio.gather(sender.send_weights(published, 1),
                                   _collect(receiver.receive_weights(1, placement=placement)))
        return got[1]
    try:
        got = asyncio.run(run())
    finally:
        sender.close()
        receiver.close()
    assert [n for n, _ in got] == [n for n, _ in weights]
    for name, tensor in got:
        home = placement.layout.view(placement.bank, name)
        assert tensor.data_ptr() == home.data_ptr()  # the very target was written and yielded
    assert [placement.layout.view(placement.bank, n)[0].item() for n, _ in weights] == [0.0, 1.0, 2.0, 3.0]
    assert ("w0", torch.float32, (64,)) in placement.asked


async def _collect(stream):
    return [(n, t.clone() if t.untyped_storage().nbytes() > t.nbytes * 4 else t) async for n, t in stream]


def test_send_buffer_facts_are_on_the_engine_classes():
    from ckpt.base import CheckpointEngine
    from ckpt.collective import CollectiveCheckpointEngine

    assert CheckpointEngine.send_buffer_bytes(1 << 20, 5 << 20) == {} and CheckpointEngine.send_buffer_words == ""
    assert CollectiveCheckpointEngine.send_buffer_bytes(1 << 20, 5 << 20) == {"buckets_bytes": 3 << 20}
    for name, expected in (("nixl", {"buckets_bytes": 3 << 20}), ("mooncake", {"buckets_bytes": 3 << 20}),
                           ("kimi", {"pinned_update_bytes": 5 << 20})):
        try:
            cls = ckpt.checkpoint_engine_factory(name)
        except ckpt.CheckpointEngineError:
            continue
        assert cls.send_buffer_bytes(1 << 20, 5 << 20) == expected, name
        assert cls.send_buffer_words, name


def test_the_bank_layout_and_a_buckets_packed_layout_agree():
    """One planner: a bucket packs tensors at the offsets a WeightLayout gives them."""
    weights = [("a", torch.zeros(3)), ("b", torch.zeros(5, dtype=torch.bfloat16)), ("c", torch.zeros(100))]
    layout = ckpt.WeightLayout(weights)
    (bucket, _end) = list(plan_messages(weights, 1, 1 << 16, 64 << 10, torch.device("cpu"), direct_threshold=0))
    assert {e.name: e.offset for e in bucket.meta.entries} == {n: s.offset for n, s in layout.slots.items()}
    assert [s.offset for s in layout.slots.values()] == [0, 64, 128]


def test_a_master_whose_port_is_taken_names_it_and_can_prepare_once_it_is_free():
    with held_port() as port:
        engine = ckpt.get_checkpoint_engine("collective", is_master=True, master_addr="127.0.0.1",
                                            master_port=port, timeout=2, device="cpu")
        with pytest.raises(ckpt.CheckpointConfigError, match=f"cannot host .* store at 127.0.0.1:{port}"):
            engine.prepare()
    try:
        assert engine.prepare()["master_port"] == port  # nothing half-made stands in the way of a retry
    finally:
        engine.close()
