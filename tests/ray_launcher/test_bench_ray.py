"""bench_ray's own parts (the launcher runs themselves are what the sync tests cover)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from hal.apps.benchmarks import bench_ray


def test_the_model_holds_exactly_the_bytes_asked_for(tmp_path):
    path = tmp_path / "m.safetensors"
    nbytes = bench_ray.write_model(path, 3)
    tensors = load_file(str(path))
    assert nbytes == 3 << 20 == sum(t.numel() * t.element_size() for t in tensors.values())
    assert {t.dtype for t in tensors.values()} == {bench_ray.torch.bfloat16}


def test_throughput_skips_the_warm_up_step_and_needs_two_steps():
    rows = [{"bytes": 10**9, "publish_s": 10.0}, {"bytes": 10**9, "publish_s": 0.5}, {"bytes": 10**9, "publish_s": 2.0}]
    assert bench_ray._gbps(rows) == [2.0, 0.5]
    with pytest.raises(ValueError, match="steps must be >= 2"):
        bench_ray.run(1, steps=1)


def test_a_run_is_retried_once_when_its_port_was_taken_and_other_failures_pass_through():
    calls = []

    def flaky(args):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("a sync process failed: ... EADDRINUSE, message: address already in use")
        return {"ok": args}

    assert bench_ray._execute_retrying(flaky, "a") == {"ok": "a"} and calls == ["a", "a"]

    def broken(args):
        raise RuntimeError("a sync process failed: checksum differs")

    with pytest.raises(RuntimeError, match="checksum differs"):
        bench_ray._execute_retrying(broken, "a")
