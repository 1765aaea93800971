"""The project's pytest plugin: opt-in, device lanes, refusal of untestable lanes, a store on a port the kernel picks; and a
foreign suite that never asked for it runs exactly as it would without hal installed."""

import os
import subprocess
import sys
import textwrap

import pytest

import hal
from devices.npu_sim.ext import cache_root

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


def test_hal_store_is_served_on_a_port_the_kernel_picked_for_other_processes_to_join(pytester, monkeypatch):
    monkeypatch.setenv("HAL_CACHE_DIR", CACHE_ROOT)
    pytester.makepyfile(test_inner=textwrap.dedent("""
        import subprocess, sys

        def test_join(hal_store):
            assert hal_store.port > 0
            subprocess.run([sys.executable, "-c", "import hal; s = hal.connect_store('127.0.0.1', "
                            f"{hal_store.port}, 1, 2, timeout=30, is_master=False); s.set('k', 'joined')"],
                           check=True, timeout=120)
            assert hal_store.get("k") == b"joined"
    """))
    pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "hal.pytest_plugin").assert_outcomes(passed=1)
