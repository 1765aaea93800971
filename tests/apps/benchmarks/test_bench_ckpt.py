"""The collective engine's benchmark: what a run reports is what its ranks moved and measured."""

import pytest
import torch

import hal
from hal.apps.benchmarks import bench_ckpt
from hal.apps.errors import UsageError


def test_tensor_mix_is_log_uniform_bf16_sizes_summing_to_the_total():
    sizes = bench_ckpt.tensor_sizes(1 << 30)
    assert sum(sizes) == 1 << 30 and 300 <= len(sizes) <= 800
    assert min(sizes[:-1]) >= 2 << 10 and max(sizes) <= 18 << 20 and all(s % 2 == 0 for s in sizes)


def test_the_views_lie_end_to_end_in_the_flat_buffer():
    flat = torch.arange(10, dtype=torch.uint8)
    views = bench_ckpt.tensor_views(flat, [4, 2, 4])
    assert [n for n, _ in views] == ["layer0.weight", "layer1.weight", "layer2.weight"]
    assert [t.view(torch.uint8).tolist() for _, t in views] == [[0, 1, 2, 3], [4, 5], [6, 7, 8, 9]]
    assert all(t.dtype == torch.bfloat16 and t.untyped_storage().data_ptr() == flat.data_ptr() for _, t in views)
    with pytest.raises(ValueError, match=">= 12 bytes"):
        bench_ckpt.tensor_views(flat, [6, 6])


def _measured(times: dict, peaks: list[int], moved: list[int]) -> dict:
    return {"device": "cpu", "backend": "gloo", "size_bytes": 4 * 10**9, "n_tensors": 3, "rounds": 3,
            "times": times, "peaks": peaks, "moved_bytes": moved}


def test_a_ratio_is_the_median_of_each_rounds_ratio_not_the_ratio_of_the_medians():
    # the reference and the engine, round by round: 1 / 2, 2 / 1, 10 / 5. Medians: 2 s and 2 s (ratio 1.0);
    # per-round ratios 0.5, 2, 2 (median 2.0): a noisy round slows both, so the ratio is taken per round.
    times = {"single": [1.0, 2.0, 10.0], "per_tensor": [4.0, 4.0, 4.0], "flat:1048576": [2.0, 1.0, 5.0]}
    send = _measured(times, [3 << 20], [4 * 10**9])
    recv = _measured({}, [1 << 20], [4 * 10**9])
    out = bench_ckpt.figures(send, recv, [1 << 20], ["flat"])
    (row,) = out["buckets"]
    assert (row["s"], row["gbps"], row["ratio_vs_single"], row["ratio_vs_per_tensor"]) == (2.0, 2.0, 2.0, 2.0)
    assert (out["single_s"], out["single_gbps"], out["per_tensor_ratio"]) == (2.0, 2.0, 0.5)
    assert (row["send_peak_buckets"], row["recv_peak_buckets"]) == (3.0, 1.0)
    assert out["moved_bytes"] == [4 * 10**9]


def test_bucket_sizes_and_layouts_are_checked_before_any_rank_starts(monkeypatch):
    monkeypatch.setattr(bench_ckpt, "run_ranks", lambda *a, **k: pytest.fail("ranks started"))
    with pytest.raises(UsageError, match="--bucket-mb must be positive, got 0"):
        bench_ckpt.run(1, [0], "cpu")
    with pytest.raises(ValueError, match="layouts must be a non-empty subset"):
        bench_ckpt.run(1, [1], "cpu", layouts=["rows"])


@pytest.mark.multiprocess
def test_a_tiny_run_moves_every_byte_of_its_tensor_mix(hal_device):
    result = bench_ckpt.run(2, [0.5, 1], hal_device, rounds=1, layouts=["flat"])
    sizes = bench_ckpt.tensor_sizes(2 << 20)
    assert (result["size_bytes"], result["n_tensors"]) == (sum(sizes), len(sizes))
    assert result["moved_bytes"] == [2 << 20]  # the receiver got the whole mix in every transfer
    assert result["backend"] == hal.get_dist_backend(hal_device)
    rows = result["buckets"]
    assert [(r["layout"], r["bucket_bytes"]) for r in rows] == [("flat", 1 << 19), ("flat", 1 << 20)]
    for r in rows:
        # sender: two send buffers; receiver: one bucket plus the largest tensor above a bucket (<= 18 MiB)
        assert r["send_peak_bytes"] <= 2 * r["bucket_bytes"] + (6 << 20)
        assert r["recv_peak_bytes"] <= r["bucket_bytes"] + (18 << 20) + (6 << 20)
