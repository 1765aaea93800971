"""hal sync's argument checks, and the job options they become, without starting a rank."""

import pytest

from hal.apps.errors import UsageError, mib_to_bytes
from hal.apps.cli.sync import Sync, job_options, validate

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


def test_the_job_options_have_the_kind_resolved_the_preset_key_and_the_bucket_in_bytes(tmp_path):
    options = job_options(Sync(device="cpu", model="QWEN2.5-tiny", bucket_mb=0.5, engine="file", steps=7))
    assert (options.device, options.model, options.bucket_bytes, options.steps) == ("cpu", "qwen2.5-tiny", 1 << 19, 7)
    assert options.file_root is not None and options.offload_flags == {}
    given = job_options(Sync(device="cpu", model="qwen2.5-tiny", engine="file", file_root=str(tmp_path), offload="all"))
    assert given.file_root == str(tmp_path) and given.offload_flags == {"model": True, "optimizer": True, "grad": True}
    assert job_options(Sync(device="cpu", model="qwen2.5-tiny")).file_root is None  # only the file engine needs one


def test_vllm_rollouts_take_full_updates_only():
    with pytest.raises(UsageError, match="--rollout vllm takes --wire-format full, got --wire-format delta"):
        validate(Sync(device="cpu", model="qwen2.5-tiny", rollout="vllm", wire_format="delta"))
