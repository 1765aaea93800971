"""The project's pytest plugin: device lanes, skip reasons, markers and xdist-safe ports."""

import os
import subprocess
import sys
import textwrap

import pytest

import hal
from hal.testing import free_port

INNER = textwrap.dedent('''
    import pytest

    def test_lane(device):
        print("LANE", device)

    @pytest.mark.device("cpu")
    def test_cpu_only(device):
        assert device == "cpu"
''')


def _inner_pytest(tmp_path, *args, env=None):
    (tmp_path / "test_inner.py").write_text(INNER)
    full_env = {k: v for k, v in os.environ.items() if k not in ("HAL_DEVICE", "HAL_TEST_DEVICES",
                                                                  "PYTEST_XDIST_WORKER")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "-v",
                           str(tmp_path / "test_inner.py"), *args],
                          capture_output=True, text=True, timeout=120, env=full_env, cwd=tmp_path)


def test_unavailable_lane_is_skipped_with_the_missing_piece_named(tmp_path):
    if hal.availability("cuda"):
        pytest.skip("cuda is present here")
    out = _inner_pytest(tmp_path, "--device", "cuda,cpu")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "test_lane[cpu] PASSED" in out.stdout
    assert "test_lane[cuda] SKIPPED" in out.stdout
    assert "device kind 'cuda' unavailable:" in out.stdout and "CUDA" in out.stdout
    assert "test_cpu_only[cpu] PASSED" in out.stdout and "test_cpu_only[cuda]" not in out.stdout


def test_lanes_from_environment_variable(tmp_path):
    out = _inner_pytest(tmp_path, env={"HAL_TEST_DEVICES": "cpu"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "test_lane[cpu] PASSED" in out.stdout and "test_lane[npu-sim]" not in out.stdout


def test_unknown_lane_is_skipped_naming_the_known_kinds(tmp_path):
    out = _inner_pytest(tmp_path, "--device", "tpu")
    assert "test_lane[tpu] SKIPPED" in out.stdout
    assert "unknown device kind 'tpu'" in out.stdout


def test_free_ports_differ_across_calls_and_xdist_workers(monkeypatch):
    ports = {free_port() for _ in range(20)}
    assert len(ports) == 20
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    gw0 = free_port()
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    gw1 = free_port()
    assert 21000 <= gw0 < 21500 and 21500 <= gw1 < 22000  # disjoint ranges per worker
