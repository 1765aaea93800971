"""bench_ray's own parts (the launcher runs themselves are what the sync tests cover)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from hal.apps.benchmarks import bench_ray
from hal.apps.benchmarks.job import retry_port_taken


def test_the_model_holds_exactly_the_bytes_asked_for(tmp_path):
    path = tmp_path / "m.safetensors"
    nbytes = bench_ray.write_model(path, 3)
    tensors = load_file(str(path))
    assert nbytes == 3 << 20 == sum(t.numel() * t.element_size() for t in tensors.values())
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}


def test_throughput_skips_the_warm_up_step_and_needs_two_steps():
    rows = [{"bytes": 10**9, "publish_s": 10.0}, {"bytes": 10**9, "publish_s": 0.5}, {"bytes": 10**9, "publish_s": 2.0}]
    assert bench_ray.step_gbps(rows) == [2.0, 0.5]
    with pytest.raises(ValueError, match="steps must be >= 2"):
        bench_ray.run(1, steps=1)


def test_a_run_is_retried_once_when_its_port_was_taken_and_other_failures_pass_through():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a sync process failed: ... EADDRINUSE, message: address already in use")
        return {"ok": len(calls)}

    assert retry_port_taken(flaky) == {"ok": 2} and len(calls) == 2

    def broken():
        calls.append(1)
        raise RuntimeError("a sync process failed: checksum differs")

    calls.clear()
    with pytest.raises(RuntimeError, match="checksum differs"):
        retry_port_taken(broken)
    assert len(calls) == 1
