"""Every trainer rank a sender (issue 22): the collective engine's multi-sender topology across processes.

2 and 4 senders x 2 rollouts, each sender publishing its FSDP2 dim-0 rows (odd row counts, a tensor with fewer
rows than senders, an empty one, 1-d and 0-d tensors one sender owns whole, a part above a bucket); one rollout
receives parts straight into its atomic ModelRolloutAdapter's staging bank, the other assembles them (no
placement). A trainer rank killed mid-update: every rollout keeps its previous step and the error names it.
"""

import asyncio

import pytest
import torch

import ckpt
from ckpt.multi_sender import PartAssembler, published
from ckpt.one_to_many import OneToManyEngine
from hal.apps.multiprocess import run_multiprocess
from tests.ckpt import mp_workers

TOTAL = len(mp_workers.sharded_weights(0))


def _master(multi: bool) -> dict:
    md = {"is_master": True, "master_addr": "h", "master_port": 5, "generation": 0, "joined": None}
    if multi:
        md["multi_sender"] = True
    return md


def test_build_topology_gives_every_trainer_rank_a_sender_role_only_with_multi_sender():
    metadata = [_master(True)] + [{} for _ in range(2 + 2 - 1)]
    trainer, rollout = OneToManyEngine.build_topology(2, 2, metadata)
    assert trainer == {"rank": [0, 1], "world_size": [4, 4], "master_addr": ["h", "h"], "master_port": [5, 5],
                       "generation": [1, 1], "num_senders": [2, 2]}
    assert rollout["rank"] == [2, 3] and rollout["num_senders"] == [2, 2]
    # the default: trainer rank 0 alone sends, the others drain (-1); the entries are as before
    trainer, rollout = OneToManyEngine.build_topology(2, 2, [_master(False)] + [{}] * 3)
    assert trainer == {"rank": [0, -1], "world_size": [3, 3], "master_addr": ["h", "h"], "master_port": [5, 5],
                       "generation": [1, 1]}
    assert rollout == {"rank": [1, 2], "world_size": [3, 3], "master_addr": ["h", "h"], "master_port": [5, 5],
                       "generation": [1, 1]}
    # one trainer rank: one sender whatever the option (as verl's multi-sender degrades)
    trainer, _ = OneToManyEngine.build_topology(1, 2, [_master(True)] + [{}] * 2)
    assert trainer["rank"] == [0] and "num_senders" not in trainer


def test_multi_sender_option_is_reported_by_the_master_and_refused_where_unsupported():
    engine = ckpt.CollectiveCheckpointEngine(is_master=True, master_addr="127.0.0.1", device="cpu",
                                             multi_sender=True, timeout=10)
    try:
        assert engine.prepare()["multi_sender"] is True
    finally:
        engine.close()
    assert "multi_sender" not in ckpt.CollectiveCheckpointEngine(device="cpu").prepare()
    with pytest.raises(ckpt.CheckpointConfigError, match="multi_sender must be True or False"):
        ckpt.CollectiveCheckpointEngine(device="cpu", multi_sender="yes")


def test_published_marks_row_parts_and_checks_them():
    full = torch.arange(12.0).reshape(6, 2)
    pairs, parts = published([("w", ckpt.RowShard(full[3:6], 3, (6, 2))), ("b", torch.ones(3))])
    assert [n for n, _ in pairs] == ["w", "b"] and parts == {"w": ([6, 2], 3)}
    with pytest.raises(ckpt.CheckpointConfigError, match="row shard of 'w'"):
        published([("w", ckpt.RowShard(full[3:6], 4, (6, 2)))])
    assert [ckpt.dim0_rows(3, 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 3)]
    assert [ckpt.dim0_rows(7, 2, r) for r in range(2)] == [(0, 4), (4, 7)]


def test_part_assembler_completes_a_tensor_once_and_refuses_overlaps():
    full = torch.arange(10.0).reshape(5, 2)
    asm = PartAssembler(None, torch.device("cpu"))
    assert asm.add("w", full[3:5], ([5, 2], 3)) is None
    assert asm.missing() == ["w (2 of 5 rows)"]
    name, got = asm.add("w", full[0:3].clone(), ([5, 2], 0))
    assert name == "w" and torch.equal(got, full) and asm.missing() == []
    assert asm.add("w", full[0:0], ([5, 2], 5)) is None  # another sender's empty shard
    with pytest.raises(ckpt.TransferError, match="after the tensor was complete"):
        asm.add("w", full[0:1], ([5, 2], 0))
    asm.add("v", full[0:3], ([5, 2], 0))
    with pytest.raises(ckpt.TransferError, match="overlap"):
        asm.add("v", full[0:3], ([5, 2], 0))


def _check_rollouts(results, trainers, updates, device_type):
    for rank in range(trainers, trainers + 2):
        reports = results[rank]
        assert [r["update"] for r in reports] == list(range(1, updates + 1))
        for r in reports:
            assert r["error"] is None, (rank, r)
            assert (r["served_step"], r["exact"], r["total"]) == (r["update"], TOTAL, TOTAL), (rank, r)
            assert r["kwargs"]["num_senders"] == trainers and r["kwargs"]["rank"] == rank
            assert r["devices"] == [device_type]


@pytest.mark.multiprocess
def test_senders_times_two_rollouts_byte_exact_with_row_sharded_tensors(hal_device):
    import hal

    # 2 senders on one lane, 4 on the other (the lanes' count is the engine's, whatever the backend): each
    # lane's backend and each sender count once, two process groups instead of four
    trainers = 4 if hal_device == "npu-sim" else 2
    updates = 2  # a list (zero-copy runs) and a generator
    results = run_multiprocess(mp_workers.multi_sender, trainers + 2, hal_device, trainers, updates, timeout=180)
    for rank in range(trainers):
        for r in results[rank]:
            assert r["error"] is None, (rank, r)
            assert r["topology"]["role"] == "sender" and r["topology"]["senders"] == list(range(trainers))
    _check_rollouts(results, trainers, updates, hal.get_device(hal_device).type)


@pytest.mark.multiprocess
def test_a_trainer_rank_killed_mid_update_leaves_every_rollout_on_its_previous_step(hal_device):
    results = run_multiprocess(mp_workers.multi_sender, 4, hal_device, 2, 2, (2, 1), timeout=180,
                               expect_failure=True)
    assert 1 not in results  # the killed rank returned nothing
    # trainer rank 0's own lane completed, and the rollouts told it they applied nothing (issue 50, point 4)
    refused = results[0][1]["error"]
    assert refused.startswith("UpdateRefusedError: step 2 was not applied by 2 of 2 reporting rollouts"), refused
    assert "rollout rank 2: " in refused and "rollout rank 3: " in refused and "sender trainer rank 1" in refused
    for rank in (2, 3):
        first, second = results[rank]
        assert first["error"] is None and first["served_step"] == 1 and first["exact"] == TOTAL
        assert second["error"] is not None and "sender trainer rank 1" in second["error"], second
        assert second["error"].split(":")[0] in ("TransferError", "TransferTimeoutError"), second
        assert second["served_step"] == 1 and second["exact"] == TOTAL, second  # the previous step, intact


def test_the_single_sender_default_is_unchanged_in_process():
    """With multi_sender off, a 2-rank trainer is one sender (rank 0) plus a draining rank (-1)."""
    engine = ckpt.CollectiveCheckpointEngine(device="cpu")
    engine.init_process_group(rank=-1, world_size=3, master_addr="h", master_port=5)
    assert engine.topology["role"] == "outside" and not engine.is_sender
    drained = []
    asyncio.run(engine.send_weights((drained.append(i) or ("w", torch.ones(1)) for i in range(3)), 1))
    assert drained == [0, 1, 2]


def test_a_short_run_closing_the_last_bucket_is_copied_into_that_buckets_buffer():
    """Regression (found by bench_senders' byte check): a short run pending when the input ends (or when a
    tensor larger than a bucket follows) was packed into buffer_for(k + 1), the buffer of a message still in
    flight with three buffers in rotation, instead of buffer_for(k)."""
    from ckpt.bucket import plan_messages

    bucket = 1 << 16
    asked: list[int] = []
    buffers: dict[int, torch.Tensor] = {}

    def buffer_for(k: int) -> torch.Tensor:
        asked.append(k)
        return buffers.setdefault(k, torch.zeros(bucket, dtype=torch.uint8))

    # two buckets, each a 40 KB run (sent from its own storage) then a short run (packed: copied into the
    # bucket's buffer when the bucket closes)
    weights = [("a", torch.full((10000,), 1.0)), ("s", torch.full((100,), 7.0)),
               ("b", torch.full((10000,), 2.0)), ("t", torch.full((100,), 8.0))]
    for end in ("input ends", "a larger tensor follows"):
        asked.clear()
        buffers.clear()
        items = weights + ([("huge", torch.zeros(bucket))] if end != "input ends" else [])
        msgs = [m for m in plan_messages(items, 1, bucket, 8 << 10, torch.device("cpu"), 1 << 12,
                                         buffer_for=buffer_for) if m.meta.entries]
        assert len(msgs) == 2, end
        for k, msg in enumerate(msgs):
            for e in msg.meta.entries:
                if e.name in ("s", "t"):
                    assert msg.buffer is buffers[k], (end, e.name, k, asked)
                    got = msg.buffer[e.offset:e.offset + e.nbytes].view(torch.float32)
                    assert torch.equal(got, dict(weights)[e.name]), (end, e.name)


@pytest.mark.multiprocess
def test_fsdp2_dtensors_become_the_row_shards_torch_chunk_gives():
    results = run_multiprocess(mp_workers.dtensor_rows, 2, timeout=60)
    assert results[0] == [(7, 0, (4, 3), (7, 3), True), (1, 0, (1, 3), (1, 3), True), (3,),
                          [("w", "RowShard", torch.bfloat16), ("buf", "Tensor", torch.int64)]]
    assert results[1] == [(7, 4, (3, 3), (7, 3), True), (1, 1, (0, 3), (1, 3), True), None,
                          [("w", "RowShard", torch.bfloat16)]]  # the plain buffer: rank 0 sends it
