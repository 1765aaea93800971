"""Smoke test of benchmarks/bench_ckpt.py: a small run returns consistent figures on each device kind."""

import pytest

import hal

from hal.apps.benchmarks import bench_ckpt

pytestmark = pytest.mark.multiprocess


def test_tensor_mix_is_log_uniform_bf16_sizes_summing_to_the_total():
    sizes = bench_ckpt.tensor_sizes(1 << 30)
    assert sum(sizes) == 1 << 30 and 300 <= len(sizes) <= 800
    assert min(sizes[:-1]) >= 2 << 10 and max(sizes) <= 18 << 20 and all(s % 2 == 0 for s in sizes)


def test_small_run_reports_ratios_and_bounded_peaks(hal_device):
    result = bench_ckpt.run(16, [2, 4], hal_device, rounds=1)
    assert result["size_bytes"] == 16 << 20 and result["n_tensors"] > 5
    assert result["backend"] == hal.get_dist_backend(hal_device)
    rows = result["buckets"]
    assert [(r["layout"], r["bucket_bytes"]) for r in rows] == [
        ("separate", 2 << 20), ("separate", 4 << 20), ("flat", 2 << 20), ("flat", 4 << 20)]
    for r in rows:
        # one round: each ratio is the reference's time over this row's (no speed floor: load decides speed)
        assert r["s"] > 0 and r["ratio_vs_single"] == pytest.approx(result["single_s"] / r["s"])
        assert r["ratio_vs_per_tensor"] == pytest.approx(result["per_tensor_s"] / r["s"])
        # sender: two send buffers; receiver: one bucket plus the largest tensor above a bucket (<= 18 MiB)
        assert r["send_peak_bytes"] <= 2 * r["bucket_bytes"] + (6 << 20)
        assert r["recv_peak_bytes"] <= r["bucket_bytes"] + (18 << 20) + (6 << 20)
