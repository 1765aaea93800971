"""``hal bench --only m2n``: resharded updates against the whole model to every rank, same links, one run."""

import math

import pytest

from hal.apps.benchmarks import bench_m2n


def test_the_model_reaches_the_size_asked_and_its_heads_allow_tp_2_and_4():
    shapes = bench_m2n.model_shapes(64 << 20)
    nbytes = sum(2 * math.prod(s) for s in shapes.values())
    assert 64 << 20 <= nbytes < (64 << 20) + 30e6  # one layer more than needed at most
    assert shapes["model.embed_tokens.weight"] == (32768, 1024) and "lm_head.weight" not in shapes  # tied
    for tp in (2, 4):
        lays = bench_m2n.layouts(shapes, tp)
        assert sum(lay.nbytes for lay in lays) == pytest.approx(nbytes, rel=0.01)  # norms whole on every rank


def test_fill_is_the_same_on_every_call_and_finite():
    a, b = bench_m2n.fill("w", (3, 5)), bench_m2n.fill("w", (3, 5))
    assert a.dtype.itemsize == 2 and bool((a.view(-1) == b.view(-1)).all()) and bool(a.float().isfinite().all())
    assert not bool((bench_m2n.fill("v", (3, 5)) == a).all())


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_each_tp_rank_receives_its_share_byte_exact_on_the_loopback():
    out = bench_m2n.run(size_mb=2, link_gbit=None, rounds=1, tps=(2,))
    row = out["tp"][2]
    assert 0.5 <= row["received_fraction"] < 0.51  # every rank checked its bytes inside the run
    assert row["m2n_s"] > 0 and row["full_s"] > 0 and row["m2n_vs_full"] == pytest.approx(row["m2n_s"] / row["full_s"])
