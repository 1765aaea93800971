"""The offload benchmark: it reports the bytes of the model it built, and each figure from its own timings."""

from __future__ import annotations

import pytest

import hal
from hal.apps.benchmarks import bench_offload


def test_a_tiny_run_reports_its_models_parameters_and_moves_them(hal_device):
    result = bench_offload.run(2, hal_device, rounds=1)
    params = list(bench_offload.make_model(2).parameters())
    spec = hal.resolve_device(hal_device)
    assert result["bytes"] == sum(p.numel() * p.element_size() for p in params)
    assert (result["tensors"], result["device"], result["moves"]) == (len(params), spec.kind, not spec.host_memory)
    if spec.host_memory:  # nothing moves: every figure says so rather than timing nothing
        assert result["host_buffer_bytes"] == 0 and result["warm_gbps"] == result["cold_ratio"] == 0.0
    else:  # the engine's host buffers hold exactly the offloaded bytes
        assert result["host_buffer_bytes"] == result["bytes"]
        assert result["warm_gbps"] > 0 and result["plain_gbps"] > 0


def test_warm_figures_are_the_halves_of_the_median_round_trip():
    # warm round trips (offload, onload): (1, 5), (3, 1), (2, 2); by total 6, 4, 4: the median one is (3, 1)
    # (sorted by total, then offload). Medians taken apart would give 2 s and 2 s instead.
    t = bench_offload.Timings(cold_s=8.0, warm_s=[(1.0, 5.0), (3.0, 1.0), (2.0, 2.0)], d2h_s=0.5, h2d_s=1.5,
                              cold_d2h_s=3.0, cold_h2d_s=1.0, h2d_fresh_s=4.0, host_alloc_s=2.0)
    f = bench_offload.figures(10**9, t)
    expected = {"offload_gbps": 1 / 3, "onload_gbps": 1.0, "warm_gbps": 0.5,
                "plain_d2h_gbps": 2.0, "plain_h2d_gbps": 1 / 1.5, "plain_gbps": 1.0, "plain_h2d_fresh_gbps": 0.25,
                # engine against plain (2 s round trip): warm 4 s, cold 8 s; the floor is host alloc + plain = 4 s
                "warm_ratio": 0.5, "cold_ratio": 0.25, "cold_floor_ratio": 0.5, "cold_vs_floor": 0.5,
                "cold_gbps": 0.25, "plain_cold_gbps": 0.5, "cold_vs_plain_cold": 0.5, "host_alloc_gbps": 0.5}
    assert f == pytest.approx(expected, rel=1e-12)


def test_run_refuses_a_size_below_one_mib():
    with pytest.raises(ValueError, match="size_mb"):
        bench_offload.run(0, "cpu")
