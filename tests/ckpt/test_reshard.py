"""M-to-N resharding (issue 47): layouts, plans, buckets, and the collective engine's point-to-point transfer."""

import pytest
import torch

import ckpt
from ckpt.one_to_many import OneToManyEngine
from ckpt.reshard import Holding, PlanError, Region, RolloutLayout, Slice, bucket_plan, check_coverage, pair_plan
from hal.apps.multiprocess import run_multiprocess
from tests.ckpt import reshard_workers as w


def _held(senders: int, rank: int) -> list[Holding]:
    out = []
    for name, t in w.full_weights(0).items():
        if name in w.WHOLE:
            if rank == 0:
                out.append(Holding(name, tuple(t.shape), t.dtype, Region.whole(t.shape)))
            continue
        a, b = ckpt.dim0_rows(t.shape[0], senders, rank)
        out.append(Holding(name, tuple(t.shape), t.dtype, Region((a,) + (0,) * (t.dim() - 1), (b - a, *t.shape[1:]))))
    return out


def test_region_intersections_and_frames():
    a, b = Region((0, 4), (6, 8)), Region((3, 0), (10, 6))
    assert a.intersect(b) == Region((3, 4), (3, 2))
    assert a.intersect(Region((6, 0), (1, 1))) is None
    assert Region((), ()).intersect(Region((), ())) == Region((), ()) and Region((), ()).numel == 1
    assert Region((3, 4), (3, 2)).moved((3, 0), (0, 0)) == Region((0, 4), (3, 2))
    assert str(Region((3, 4), (3, 2))) == "[3:6, 4:6]"
    with pytest.raises(ckpt.CheckpointConfigError, match="as many offsets as sizes"):
        Region((0,), (1, 2))


def test_each_rollout_rank_is_planned_exactly_its_slices_from_every_trainer_rank():
    for senders, tp in ((2, 2), (2, 4), (3, 2), (1, 2)):
        held = {s: _held(senders, s) for s in range(senders)}
        full = w.full_weights(0)
        for r in range(tp):
            lay = w.layout(r, tp)
            plans = {s: pair_plan(held[s], lay, s, r) for s in held}
            check_coverage(lay, plans, held, r)
            got = {t: torch.zeros(shape, dtype=dt) for t, (shape, dt) in lay.targets.items()}
            for s, pieces in plans.items():
                for p in pieces:
                    a, _ = ckpt.dim0_rows(full[p.name].shape[0], senders, s) if p.name not in w.WHOLE else (0, 0)
                    local = full[p.name][a:] if full[p.name].dim() else full[p.name]
                    got[p.target][p.dest.index()] = local[p.source.index()]
            for t, want in w.expected(0, lay).items():
                assert torch.equal(got[t], want), (senders, tp, r, t)
            assert sum(p.nbytes for ps in plans.values() for p in ps) == lay.nbytes


def test_a_layout_that_cannot_be_planned_is_refused_naming_the_parameter_and_both_sides():
    held = {s: _held(2, s) for s in range(2)}
    lay = w.layout(0, 2)
    with pytest.raises(PlanError, match=r"parameter 'q' cannot be resharded: trainer rank 0 publishes q float32 "
                                        r"\(8, 6\) holding \[0:4, 0:6\], rollout rank 2 keeps q\[0:8, 0:6\] -> "
                                        r"qkv\[0:8, 0:6\] of a float32 \(16, 6\) tensor"):
        pair_plan(held[0], w.layout(0, 2, q_rows=16), 0, 2)  # a rollout built for twice the heads
    with pytest.raises(ckpt.CheckpointConfigError, match=r"leaves part of qkv \(8, 6\) unwritten"):
        RolloutLayout([s for s in lay.slices if s.name != "k"])
    # a slice no trainer rank holds
    extra = RolloutLayout([*lay.slices, Slice("lm_head", (4, 6), Region.whole((4, 6)), "lm_head", (4, 6), (0, 0),
                                             torch.float32)])
    plans = {s: pair_plan(held[s], extra, s, 2) for s in held}
    with pytest.raises(PlanError, match="'lm_head' cannot be resharded to rollout rank 2: .*no trainer rank publishes"):
        check_coverage(extra, plans, held, 2)
    # two trainer ranks claiming the same rows
    overlap = {0: held[0], 1: held[0]}
    plans = {s: pair_plan(overlap[s], lay, s, 2) for s in overlap}
    with pytest.raises(PlanError, match="'embed' .*regions overlap"):
        check_coverage(lay, plans, overlap, 2)
    with pytest.raises(ckpt.CheckpointConfigError, match="outside"):  # rows 6..10 of an 8-row tensor
        RolloutLayout([Slice("q", (8, 6), Region((6, 0), (4, 6)), "q", (4, 6), (0, 0), torch.float32)])


def test_buckets_split_pieces_by_rows_and_both_sides_agree():
    held = _held(2, 1)
    pieces = pair_plan(held, w.layout(0, 2), 1, 2)
    buckets = bucket_plan(pieces, w.BUCKET)
    assert bucket_plan(pieces, w.BUCKET) == buckets
    for bucket in buckets:
        assert bucket[-1].offset + bucket[-1].piece.nbytes <= w.BUCKET
        assert all(item.offset % 64 == 0 for item in bucket)
    sent = {}
    for bucket in buckets:
        for item in bucket:
            sent.setdefault((item.piece.name, item.piece.target), 0)
            sent[(item.piece.name, item.piece.target)] += item.piece.region.numel
    assert sent == {(p.name, p.target): p.region.numel for p in pieces}
    assert len(buckets) > 2  # "big" columns (150 rows x 256 floats) take more than one bucket
    with pytest.raises(ckpt.CheckpointConfigError, match="smaller than one row"):
        bucket_plan(pieces, 512)


def test_build_topology_hands_every_rollout_layout_to_every_trainer_rank():
    lay = w.layout(0, 2).to_dict()
    metadata = [{"is_master": True, "master_addr": "h", "master_port": 5, "generation": 0, "joined": None,
                 "multi_sender": True}, {}, {"rollout_layout": lay}, {}]
    trainer, rollout = ckpt.CollectiveCheckpointEngine.build_topology(2, 2, metadata)
    assert trainer["rollout_layouts"] == [[lay, None], [lay, None]] and trainer["reshard"] == [True, True]
    assert rollout["reshard"] == [True, True] and "rollout_layouts" not in rollout
    with pytest.raises(ckpt.CheckpointConfigError, match="no point-to-point transfers"):
        OneToManyEngine.build_topology(2, 2, metadata)


def _fraction(report):
    return report["received"] / report["model_bytes"]


@pytest.mark.multiprocess
def test_two_trainer_ranks_to_two_tp_ranks_each_receives_only_its_slices(hal_device):
    import hal

    results = run_multiprocess(w.resharded, 4, hal_device, 2, 2, timeout=180)
    for rank in (0, 1):
        assert [r["error"] for r in results[rank]] == [None, None], results[rank]
    model_bytes = results[0][0]["model_bytes"]
    for rank in (2, 3):
        for update, r in enumerate(results[rank], 1):
            assert r["error"] is None and r["served_step"] == update, r
            assert r["exact"] == r["total"] == 7, r
            assert r["devices"] == [hal.get_device(hal_device).type]
            assert r["received"] / model_bytes < 0.52, r  # half of every split tensor, the small ones whole
    # the atomic adapter's rollout received in place; its buffers are at most two pair buckets per sender
    assert results[2][-1]["buffer_bytes"] <= 2 * 2 * (w.BUCKET // 2) + 4 * (64 << 10)


@pytest.mark.multiprocess
def test_the_ipc_engine_reshards_on_one_host_through_verls_lifecycle(hal_device):
    results = run_multiprocess(w.resharded, 4, hal_device, 2, 2, None, (), None, False, "ipc", timeout=180)
    for rank in (0, 1):
        assert [r["error"] for r in results[rank]] == [None, None], results[rank]
        assert "rollout_layouts" in results[rank][0]["kwargs_keys"]
    for rank in (2, 3):
        assert [(r["error"], r["served_step"], r["exact"]) for r in results[rank]] == [(None, 1, 7), (None, 2, 7)]


@pytest.mark.multiprocess
def test_a_whole_model_rollout_and_a_tp_rank_share_one_update():
    results = run_multiprocess(w.resharded, 4, "cpu", 2, 1, None, (1,), timeout=120)
    assert results[2][0]["exact"] == 7 and results[3][0]["exact"] == 9 and results[3][0]["total"] == 9
    assert results[3][0]["served_step"] == 1 and results[3][0]["received"] is None


@pytest.mark.multiprocess
def test_a_killed_rollout_rank_fails_the_update_in_time_and_the_other_keeps_its_step():
    import time

    start = time.monotonic()
    results = run_multiprocess(w.resharded, 4, "cpu", 2, 2, (2, 3), (), None, True, timeout=120,
                               expect_failure=True)
    assert time.monotonic() - start < 60  # every wait is bounded by the engines' 8 s timeout
    assert 3 not in results
    first, second = results[2]
    assert first["error"] is None and first["served_step"] == 1 and first["exact"] == 7
    # all its own pieces came, but its tensor-parallel peer is gone: the server keeps step 1, byte-exact
    assert "another tensor-parallel rank" in second["error"], second
    assert second["served_step"] == 1 and second["exact"] == 7
    for rank in (0, 1):
        assert results[rank][0]["error"] is None
        assert "rollout rank 3" in results[rank][1]["error"], results[rank][1]


@pytest.mark.multiprocess
def test_a_wrong_layout_is_refused_before_any_byte_moves_and_the_next_update_goes_through():
    results = run_multiprocess(w.resharded, 4, "cpu", 2, 2, None, (), (1, 2), timeout=120)
    for rank in (0, 1):
        assert "PlanError: parameter 'q' cannot be resharded" in results[rank][0]["error"], results[rank][0]
        assert "rollout rank 2 keeps q[0:8, 0:6]" in results[rank][0]["error"]
        assert results[rank][1]["error"] is None
    first, second = results[2]
    assert "PlanError" in first["error"] and "'q'" in first["error"] and first["served_step"] is None
    assert second["error"] is None and second["served_step"] == 2 and second["exact"] == 7
    assert results[3][1]["served_step"] == 2


@pytest.mark.multiprocess
def test_the_same_protocol_over_shared_slots_on_one_host(hal_device):
    import os

    results = run_multiprocess(w.shared_pairs, 4, hal_device, 2, os.urandom(4).hex(), timeout=180)
    for rank in (0, 1):
        assert [r["error"] for r in results[rank]] == [None, None], results[rank]
        assert 0 < results[rank][0]["slot_bytes"] <= 2 * 2 * (w.BUCKET // 2)  # two slots per rollout rank
    for rank in (2, 3):
        assert [(r["error"], r["exact"]) for r in results[rank]] == [(None, 7), (None, 7)], results[rank]
