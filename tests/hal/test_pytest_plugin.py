"""The project's pytest plugin: opt-in, device lanes, refusal of untestable lanes, xdist-safe ports; and a
foreign suite that never asked for it runs exactly as it would without hal installed."""

import os
import subprocess
import sys
import textwrap

import pytest

import hal
from hal.testing import free_port

INNER = textwrap.dedent('''
    import pytest

    def test_lane(hal_device):
        print("LANE", hal_device)

    @pytest.mark.hal_device("cpu")
    def test_cpu_only(hal_device):
        assert hal_device == "cpu"
''')

# A suite in the style of verl's and vLLM's: its own `device` fixture and `device` parametrization, an
# environment check, and no mention of hal.
FOREIGN = textwrap.dedent('''
    import os
    import pytest

    @pytest.fixture
    def device():
        return "own-fixture-value"

    def test_own_fixture(device):
        assert device == "own-fixture-value"

    @pytest.mark.parametrize("device", ["cuda", "cpu"])
    def test_own_parametrize(device):
        print("PARAM", device)

    def test_environment_untouched():
        assert "HAL_SIM_STRICT" not in os.environ
''')


def _clean_env(extra=None):
    env = {k: v for k, v in os.environ.items()
           if k not in ("HAL_DEVICE", "HAL_TEST_DEVICES", "PYTEST_XDIST_WORKER", "HAL_SIM_STRICT",
                        "PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    env.update(extra or {})
    return env


def _pytest(tmp_path, source, *args, env=None):
    (tmp_path / "test_inner.py").write_text(source)
    if source is INNER:  # the opt-in, as a suite does it: in its root conftest.py
        (tmp_path / "conftest.py").write_text('pytest_plugins = ["hal.pytest_plugin"]\n')
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "-v",
                           str(tmp_path / "test_inner.py"), *args],
                          capture_output=True, text=True, timeout=120, env=_clean_env(env), cwd=tmp_path)


def test_foreign_suite_with_its_own_device_fixture_is_untouched_by_an_installed_hal(tmp_path):
    out = _pytest(tmp_path, FOREIGN)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "test_own_fixture PASSED" in out.stdout
    assert "test_own_parametrize[cuda] PASSED" in out.stdout and "test_own_parametrize[cpu] PASSED" in out.stdout
    assert "test_environment_untouched PASSED" in out.stdout
    assert "npu-sim" not in out.stdout and "hal_device" not in out.stdout
    assert "4 passed" in out.stdout


def test_the_installed_distribution_registers_no_pytest_plugin():
    from importlib.metadata import distribution

    entry_points = distribution("hal-posttrain").entry_points
    assert [ep for ep in entry_points if ep.group == "pytest11"] == []


def test_unavailable_lane_asked_for_by_name_fails_the_run(tmp_path):
    if hal.availability("cuda"):
        pytest.skip("cuda is present here")
    out = _pytest(tmp_path, INNER, "--hal-device", "cuda,cpu")
    assert out.returncode == 4, out.stdout + out.stderr  # pytest's usage-error exit code
    assert "'cuda'" in out.stderr and "CUDA" in out.stderr and "cannot be tested here" in out.stderr


def test_unknown_lane_in_the_environment_variable_fails_naming_the_known_kinds(tmp_path):
    out = _pytest(tmp_path, INNER, env={"HAL_TEST_DEVICES": "tpu"})
    assert out.returncode == 4, out.stdout + out.stderr
    assert "unknown device kind 'tpu'" in out.stderr


def test_lanes_from_environment_variable(tmp_path):
    out = _pytest(tmp_path, INNER, env={"HAL_TEST_DEVICES": "cpu"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "test_lane[cpu] PASSED" in out.stdout and "test_lane[npu-sim]" not in out.stdout
    assert "test_cpu_only[cpu] PASSED" in out.stdout


def test_marker_restricts_the_lanes(tmp_path):
    out = _pytest(tmp_path, INNER, "--hal-device", "npu-sim,cpu")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "test_lane[npu-sim] PASSED" in out.stdout and "test_lane[cpu] PASSED" in out.stdout
    assert "test_cpu_only[cpu] PASSED" in out.stdout and "test_cpu_only[npu-sim]" not in out.stdout


def test_strict_mode_is_set_only_while_the_plugin_is_enabled():
    assert os.environ.get("HAL_SIM_STRICT") == "1"  # this suite enables the plugin in tests/conftest.py


def test_free_ports_differ_across_calls_and_xdist_workers(monkeypatch):
    ports = {free_port() for _ in range(20)}
    assert len(ports) == 20
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    gw0 = free_port()
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    gw1 = free_port()
    assert 21000 <= gw0 < 21500 and 21500 <= gw1 < 22000  # disjoint ranges per worker
