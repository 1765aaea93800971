"""Smoke test of benchmarks/bench_offload.py at a small size (the CLI's ``hal bench`` calls ``run``)."""

from __future__ import annotations

import pytest

import hal
from hal.benchmarks import bench_offload


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
        assert result["warm_ratio"] == pytest.approx(result["warm_gbps"] / result["plain_gbps"])


def test_run_refuses_a_size_below_one_mib():
    with pytest.raises(ValueError, match="size_mb"):
        bench_offload.run(0, "cpu")
