"""The project's pytest plugin: opt-in, device lanes, refusal of untestable lanes, xdist-safe ports; and a
foreign suite that never asked for it runs exactly as it would without hal installed."""

import os
import subprocess
import sys
import textwrap

import pytest

import hal
from devices.npu_sim.ext import cache_root
from hal.distributed import ephemeral_port_range
from hal.testing import free_port

CACHE_ROOT = str(cache_root())  # read before pytester points HOME at a fresh folder

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
    """A fresh interpreter running pytest on ``source``: what a suite that installed hal but never enabled the
    plugin sees (entry-point plugins autoloaded, this suite's environment variables gone)."""
    (tmp_path / "test_inner.py").write_text(source)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "-v",
                           str(tmp_path / "test_inner.py"), *args],
                          capture_output=True, text=True, timeout=120, env=_clean_env(env), cwd=tmp_path)


def _inner(pytester, monkeypatch, *args, env=None):
    """pytest on :data:`INNER` in this process (pytester isolates its modules and working directory), the
    plugin enabled as a suite does it: in its root conftest.py. No interpreter to start: these tests are
    about the plugin's collection and configuration, not about a fresh process."""
    for key in ("HAL_DEVICE", "HAL_TEST_DEVICES", "HAL_SIM_STRICT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {"HAL_CACHE_DIR": CACHE_ROOT, **(env or {})}.items():  # the sim's built extension
        monkeypatch.setenv(key, value)
    pytester.makeconftest('pytest_plugins = ["hal.pytest_plugin"]\n')
    pytester.makepyfile(test_inner=INNER)
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "-rs", "-v", *args)


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


def test_unavailable_lane_asked_for_by_name_fails_the_run(pytester, monkeypatch):
    if hal.availability("cuda"):
        pytest.skip("cuda is present here")
    out = _inner(pytester, monkeypatch, "--hal-device", "cuda,cpu")
    err = out.stderr.str()
    assert out.ret == pytest.ExitCode.USAGE_ERROR, out.stdout.str() + err
    assert "'cuda'" in err and "CUDA" in err and "cannot be tested here" in err


def test_unknown_lane_in_the_environment_variable_fails_naming_the_known_kinds(pytester, monkeypatch):
    out = _inner(pytester, monkeypatch, env={"HAL_TEST_DEVICES": "tpu"})
    assert out.ret == pytest.ExitCode.USAGE_ERROR, out.stdout.str() + out.stderr.str()
    assert "unknown device kind 'tpu'" in out.stderr.str()


def test_lanes_from_environment_variable(pytester, monkeypatch):
    out = _inner(pytester, monkeypatch, env={"HAL_TEST_DEVICES": "cpu"})
    out.assert_outcomes(passed=2)
    out.stdout.fnmatch_lines(["*test_lane[[]cpu[]] PASSED*", "*test_cpu_only[[]cpu[]] PASSED*"])
    assert "test_lane[npu-sim]" not in out.stdout.str()


def test_marker_restricts_the_lanes(pytester, monkeypatch):
    out = _inner(pytester, monkeypatch, "--hal-device", "npu-sim,cpu")
    out.assert_outcomes(passed=3)
    for line in ("test_lane[npu-sim] PASSED", "test_lane[cpu] PASSED", "test_cpu_only[cpu] PASSED"):
        assert line in out.stdout.str()
    assert "test_cpu_only[npu-sim]" not in out.stdout.str()


def test_strict_mode_is_set_only_while_the_plugin_is_enabled(pytester, monkeypatch):
    assert os.environ.get("HAL_SIM_STRICT") == "1"  # this suite enables the plugin in tests/conftest.py
    # a nested run enabling it sets it for that run only, and puts back what was there (here: nothing)
    pytester.makepyfile(test_inner='import os\n\ndef test_strict():\n    assert os.environ["HAL_SIM_STRICT"] == "1"\n')
    monkeypatch.delenv("HAL_SIM_STRICT")
    monkeypatch.setenv("HAL_CACHE_DIR", CACHE_ROOT)
    pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "hal.pytest_plugin").assert_outcomes(passed=1)
    assert "HAL_SIM_STRICT" not in os.environ


def test_free_ports_differ_across_calls_and_xdist_workers(monkeypatch):
    ports = {free_port() for _ in range(20)}
    assert len(ports) == 20
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    gw0 = free_port()
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    gw1 = free_port()
    assert 21000 <= gw0 < 21500 and 21500 <= gw1 < 22000  # disjoint ranges per worker
    low, _ = ephemeral_port_range()
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw40")  # past the ranges that fit: wraps, still below the range
    assert 21000 <= free_port() < low


def test_free_port_ranges_stay_apart_where_the_ephemeral_range_leaves_no_room(tmp_path, monkeypatch):
    import hal.distributed

    wide = tmp_path / "ip_local_port_range"
    wide.write_text("1024 65535\n")
    monkeypatch.setattr(hal.distributed, "EPHEMERAL_RANGE_FILE", str(wide))
    picked = {}
    for worker in ("gw0", "gw1", "gw7"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        picked[worker] = free_port() // 500
    assert len(set(picked.values())) == 3, picked  # each worker still in a range of its own
