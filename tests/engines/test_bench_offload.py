"""Smoke test of benchmarks/bench_offload.py at a small size (the CLI's ``hal bench`` calls ``run``)."""

from __future__ import annotations

import pytest

import hal
from hal.apps.benchmarks import bench_offload


def test_run_reports_rates_and_buffers(hal_device):
    result = bench_offload.run(8, hal_device, rounds=1)
    spec = hal.resolve_device(hal_device)
    assert result["device"] == spec.kind and result["moves"] == (not spec.host_memory)
    assert result["tensors"] == bench_offload.LAYERS * bench_offload.TENSORS_PER_LAYER
    assert 4 * 2**20 < result["bytes"] <= 8 * 2**20
    assert result["rss_peak_bytes"] > result["bytes"]
    if spec.host_memory:
        assert result["warm_gbps"] == result["plain_gbps"] == 0.0 and result["host_buffer_bytes"] == 0
    else:
        assert result["host_buffer_bytes"] == result["bytes"]
        assert result["plain_gbps"] > 0 and result["warm_gbps"] > 0 and result["onload_gbps"] > 0


@pytest.mark.hal_device("npu-sim", "cuda", "npu")
def test_each_figure_comes_from_its_own_timings(hal_device, monkeypatch):
    # Scripted durations (seconds) in the order the benchmark times things: the cold round trip, three warm
    # (offload, onload) pairs, three device-to-host and three host-to-device copies, the plain cold
    # .to("cpu") and .to(device), three fresh onloads, three allocations of the host slabs alone.
    # The moves themselves still run; only the clock is scripted, so every figure is known in advance.
    script = iter([10.0, 3.0, 4.0, 1.0, 2.0, 0.5, 0.5, 6.0, 2.0, 4.0, 5.0, 1.0, 3.0, 12.0, 4.0, 8.0, 8.0, 8.0, 9.0, 11.0, 2.0])

    def timed(fn, spec):
        fn()
        return next(script)

    monkeypatch.setattr(bench_offload, "_timed", timed)
    r = bench_offload.run(8, hal_device, rounds=3)
    n = r["bytes"]
    assert next(script, None) is None  # every scripted timing was used
    expected = {
        "cold_gbps": 2 * n / 10.0 / 1e9,
        "warm_gbps": 2 * n / 3.0 / 1e9,  # the median warm round trip is (1.0 + 2.0) s
        "offload_gbps": n / 1.0 / 1e9,   # ... and its halves
        "onload_gbps": n / 2.0 / 1e9,
        "plain_d2h_gbps": n / 4.0 / 1e9,  # median of 6, 2, 4
        "plain_h2d_gbps": n / 3.0 / 1e9,  # median of 5, 1, 3
        "plain_h2d_fresh_gbps": n / 8.0 / 1e9,
        "plain_gbps": 2 * n / 7.0 / 1e9,
        "cold_ratio": 7.0 / 10.0,
        "warm_ratio": 7.0 / 3.0,
        "plain_cold_gbps": 2 * n / 16.0 / 1e9,
        "cold_vs_plain_cold": 16.0 / 10.0,
        "host_alloc_gbps": n / 9.0 / 1e9,  # median of 9, 11, 2
        "cold_floor_ratio": 7.0 / (9.0 + 7.0),  # plain round trip / (host alloc + plain round trip)
        "cold_vs_floor": (9.0 + 7.0) / 10.0,
    }
    assert {k: r[k] for k in expected} == pytest.approx(expected, rel=1e-12)
    assert r["host_buffer_bytes"] == n


def test_run_refuses_a_size_below_one_mib():
    with pytest.raises(ValueError, match="size_mb"):
        bench_offload.run(0, "cpu")
