"""One end-to-end run of ``hal sync`` per launcher on this machine, as a user runs it (the Ray launcher's is in
tests/ray_launcher/test_ray_sync.py, beside its cluster): every step verified, the same --json rows."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def hal_sync(*args: str, device: str = "cpu") -> dict:
    env = {k: v for k, v in os.environ.items() if k != "HAL_DEVICE"}
    out = subprocess.run([sys.executable, "-m", "hal.apps.cli.main", "sync", "--device", device, "--model",
                          "qwen2.5-tiny", "--steps", "2", "--timeout", "120", "--json", *args],
                         capture_output=True, text=True, timeout=290, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout)


def check_rows(result: dict, raw: bool) -> None:
    assert result["verified"] is True and result["errors"] == [] and result["memory_within"] is True
    assert [row["global_steps"] for row in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert row["tensors"] == 26 and row["bytes"] == 1_788_160  # the tiny preset in bf16
        assert [(r["rank"], r["served_step"], r["error"], r["tokens"]) for r in row["rollouts"]] == \
            [(rank, row["global_steps"], None, row["tokens"]) for rank in (1, 2)]
        assert (row["raw_s"] is not None and row["raw_s"] > 0) is raw and len(row.get("raw_s_each", [])) == 2 * raw


def test_torchrun_runs_the_job_with_the_raw_reference_and_every_rank_judged():
    result = hal_sync("--bucket-mb", "1")
    check_rows(result, raw=True)
    assert result["launcher"] == "torchrun" and result["warmup"]["raw_s"] > 0
    for row in result["rows"]:  # every rank's peak against its bound: 3 send buckets, 2 receive buckets
        assert row["memory"]["terms"]["buckets_bytes"] == 3 << 20
        assert all(r["memory"]["judged_by"]["terms"]["buckets_bytes"] == 2 << 20 for r in row["rollouts"])


def test_colocated_runs_the_job_in_one_process_without_a_raw_reference():
    result = hal_sync("--engine", "colocated")
    check_rows(result, raw=False)
    assert result["ratio_vs_raw_min"] is None and result["engine"] == "colocated"
    assert result["transport"] is None  # the engine's name says it all


def test_the_ipc_engine_runs_the_job_staged_in_its_publish_buffer():
    result = hal_sync("--engine", "ipc", "--bucket-mb", "0.25")
    check_rows(result, raw=True)
    assert result["engine"] == "ipc" and result["transport"] == "shared memory, /dev/shm"  # cpu shares no device


def test_hybrid_puts_every_rank_on_device_0_and_offloads_the_trainer_before_the_rollouts_apply():
    result = hal_sync("--engine", "ipc", "--hybrid", device="npu-sim")
    assert result["verified"] is True and result["memory_within"] is True
    assert result["hybrid"] is True and result["offload"] == "all"
    for row in result["rows"]:
        assert [(r["served_step"], r["device"]) for r in row["rollouts"]] == [(row["global_steps"], "npu:0")] * 2
        # the trainer's model, gradients and optimizer states were on the host while the rollouts applied
        assert row["tensor_home"] == {"model": "cpu", "optimizer": "cpu", "grad": "cpu"}
        assert row["raw_s"] is None  # no raw reference: a communicator refuses two ranks on one device
