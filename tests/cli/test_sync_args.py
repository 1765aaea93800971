"""hal sync's argument checks and stated memory bounds, without starting a rank."""

import pytest

from hal.apps.cli.errors import UsageError, mib_to_bytes
from hal.apps.cli.sync import RUNTIME_BYTES, Sync, engine_send_term, trainer_memory_bound, validate

MODEL, OPT, PUBLISHED, BUCKET = 4_000_000, 8_000_000, 1_000_000, 3 << 20


def bound(engine: str, peak: int = 0) -> dict:
    return trainer_memory_bound(peak, param_bytes=MODEL, grad_bytes=MODEL, optimizer_bytes=OPT, engine=engine,
                                bucket_bytes=BUCKET, published_bytes=PUBLISHED)


def test_the_trainer_bound_counts_what_each_engine_holds_to_send():
    collective, file, colocated = bound("collective"), bound("file"), bound("colocated")
    base = {"model_bytes": 2 * MODEL, "optimizer_bytes": OPT, "constant_bytes": RUNTIME_BYTES}
    assert collective["terms"] == {**base, "buckets_bytes": 3 * BUCKET}
    assert collective["bound_bytes"] == 2 * MODEL + OPT + 3 * BUCKET + RUNTIME_BYTES
    assert collective["form"] == "model (parameters + gradients) + optimizer + 3 buckets + constant"
    # the file engine writes shards of host copies: no bucket, at most the whole update
    assert file["terms"] == {**base, "host_copies_bytes": PUBLISHED}
    assert file["bound_bytes"] == 2 * MODEL + OPT + PUBLISHED + RUNTIME_BYTES
    assert "bucket" not in file["form"] and "host copies" in file["form"]
    assert colocated["terms"] == base and colocated["form"] == "model (parameters + gradients) + optimizer + constant"
    assert bound("kimi")["terms"]["pinned_update_bytes"] == PUBLISHED
    assert bound("nixl")["terms"] == bound("mooncake")["terms"] == collective["terms"]
    limit = file["bound_bytes"]
    assert bound("file", peak=limit)["within"] is True and bound("file", peak=limit + 1)["within"] is False
    with pytest.raises(UsageError, match="'ucx'"):
        engine_send_term("ucx", BUCKET, PUBLISHED)


def test_bucket_sizes_are_mib_with_fractions_and_refused_by_flag_when_not_positive():
    assert mib_to_bytes(256, "--bucket-mb") == 256 << 20 and mib_to_bytes(0.5, "--bucket-mb") == 1 << 19
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(UsageError, match=f"--bucket-mb must be positive, got {bad}"):
            mib_to_bytes(bad, "--bucket-mb")
    with pytest.raises(UsageError, match="--main-bucket-mb 1e-09 MiB is less than one byte"):
        mib_to_bytes(1e-9, "--main-bucket-mb")
    with pytest.raises(UsageError, match="--bucket-mb must be positive, got -2"):
        validate(Sync(device="cpu", model="qwen2.5-tiny", bucket_mb=-2))


def test_a_preset_in_another_letter_case_is_that_preset(tmp_path, monkeypatch):
    validate(Sync(device="cpu", model="Qwen2.5-TINY", engine="colocated"))  # no missing-file error
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="presets: qwen2.5-0.5b, qwen2.5-tiny"):
        validate(Sync(device="cpu", model="Qwen2.5-huge", engine="colocated"))
