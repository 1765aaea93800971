"""The prepared accelerator check (``scripts/accel_check.py``): it runs end to end on cpu and npu-sim, reports every
step in one table with positive finite ratios, keeps only the device lane of the tests, shares its budget
among the steps, and a step that fails or runs out of time is reported so and makes the exit status 1."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "accel_check.py"
sys.path.insert(0, str(SCRIPT.parent))  # as the check's children and `pytest -p accel_check` find it
import accel_check  # noqa: E402  (scripts/ is a scripts folder, not a package)
QUICK_LANE = ["tests/apps/benchmarks/test_bench_offload.py", "tests/engines/test_tensor_holders.py"]
"""A device lane of a few seconds with at least one test that passes on cpu and on npu-sim."""
FACTS = {"device": "k", "device_count": 1, "host_memory": False, "dist_backend": "b", "ipc_engine": [True, ""]}


def _script(tmp_path: Path, *args: str, timeout: float) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OUT": str(out)}
    done = subprocess.run([sys.executable, str(SCRIPT), *args, "--json", str(tmp_path / "check.json")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)
    result = json.loads((tmp_path / "check.json").read_text())
    assert json.loads((out / "accel_check.json").read_text()) == result  # $OUT gets the same JSON
    return done, result


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.hal_device("cpu", "npu-sim")  # never in an accelerator's lane: the check would run itself there
def test_the_check_runs_every_step_and_prints_one_table(hal_device, tmp_path):
    done, result = _script(tmp_path, "--device", hal_device, "--size-mb", "2", "--rounds", "1", "--budget-s", "200",
                           "--workers", "0", "--tests", *QUICK_LANE, timeout=230)
    assert done.returncode == 0, done.stdout + done.stderr
    steps = {s["name"]: s for s in result["steps"]}
    assert list(steps) == list(accel_check.STEPS) and result["ok"] and result["device"] == hal_device
    moves = hal_device != "cpu"
    assert {n: s["status"] for n, s in steps.items()} == {
        "info": "pass", "tests": "pass", "offload": "pass" if moves else "skip", "sync": "pass", "ipc": "pass"}
    for name in ("tests", "sync", "ipc") + (("offload",) if moves else ()):
        ratio = steps[name]["ratio"]
        assert isinstance(ratio, float) and math.isfinite(ratio) and ratio > 0, (name, ratio)
    assert steps["tests"]["figures"]["passed"] >= 1 and steps["tests"]["figures"]["failed"] == 0
    assert steps["ipc"]["figures"]["verified"] and result["facts"]["device"] == hal_device
    # one table: a row per step, then the verdict; and the whole tests' log under $OUT
    table = done.stdout[:done.stdout.index("accelerator check: PASS")]
    assert table.count("accelerator check on") == 1
    for name in accel_check.STEPS:
        assert f"│ {name} " in table, name
    assert "passed" in (tmp_path / "out" / "accel_check_tests.log").read_text()


@pytest.mark.timeout(120)
def test_an_impossible_budget_is_reported_as_timeouts_with_exit_status_1(tmp_path):
    done, result = _script(tmp_path, "--device", "cpu", "--budget-s", "0.5", "--steps", "info", "tests", timeout=100)
    assert done.returncode == 1
    assert [(s["name"], s["status"]) for s in result["steps"]] == [("info", "timeout"), ("tests", "timeout")]
    assert not result["ok"] and "accelerator check: FAIL" in done.stdout
    assert "budget was spent before it started" in result["steps"][1]["note"]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_failing_step_is_reported_and_the_check_goes_on(tmp_path):
    # a -k that selects nothing: pytest exits 5, the tests step fails, the next step still runs and passes
    done, result = _script(tmp_path, "--device", "npu-sim", "--size-mb", "2", "--rounds", "1", "--budget-s", "100",
                           "--steps", "tests", "offload", "--workers", "0", "--tests", QUICK_LANE[1],
                           "--tests-k", "no_such_test", timeout=110)
    assert done.returncode == 1
    steps = {s["name"]: s for s in result["steps"]}
    assert steps["tests"]["status"] == "fail" and "no test selected" in steps["tests"]["note"]
    assert steps["offload"]["status"] == "pass" and steps["offload"]["ratio"] > 0
    assert "FAIL" in done.stdout and "tests: end of its output" in done.stdout


def test_the_plugin_keeps_only_the_tests_parametrized_over_the_requested_kind(pytester):
    pytester.makepyfile(test_lane=textwrap.dedent("""
        import pytest

        def test_on_a_device(hal_device):
            pass

        @pytest.mark.parametrize("x", [1, 2])
        def test_the_same_everywhere(x):
            pass
    """))
    result = pytester.runpytest("-p", "hal.pytest_plugin", "-p", accel_check.MODULE, "--hal-device", "cpu", "-v")
    result.assert_outcomes(passed=1, deselected=2)
    result.stdout.fnmatch_lines(["*test_on_a_device?cpu? PASSED*"])


def test_each_step_gets_its_share_of_what_is_left_and_at_least_the_floor():
    pending = ["tests", "offload", "sync", "ipc"]  # weights 8, 3, 4, 4
    assert accel_check.deadline_for("tests", 380.0, pending) == pytest.approx(160.0)
    assert accel_check.deadline_for("offload", 100.0, ["offload", "ipc"]) == pytest.approx(100 * 3 / 7)
    assert accel_check.deadline_for("offload", 40.0, ["offload", "ipc"]) == accel_check.FLOOR_S  # floor
    assert accel_check.deadline_for("ipc", 10.0, ["ipc"]) == 10.0 and accel_check.deadline_for("ipc", 0, ["ipc"]) == 0
    with pytest.raises(ValueError, match="pending"):
        accel_check.deadline_for("sync", 10.0, ["ipc"])


def test_steps_that_cannot_measure_on_the_kind_are_skipped_saying_why():
    opts = accel_check.Options(rollouts=1)
    assert accel_check.skip_reason("offload", {}, opts) is None  # no facts: the step reports for itself
    assert "nothing to offload" in accel_check.skip_reason("offload", {**FACTS, "host_memory": True}, opts)
    assert "needs 2 k devices (one per rank, as b requires), 1 visible" == accel_check.skip_reason("sync", FACTS, opts)
    assert accel_check.skip_reason("sync", {**FACTS, "device_count": 2}, opts) is None
    assert accel_check.skip_reason("sync", {**FACTS, "host_memory": True}, opts) is None  # ranks share the host
    assert "needs 3" in accel_check.skip_reason("ipc", {**FACTS, "device_count": 2}, opts)
    assert "ipc engine unavailable on k: no zmq" == accel_check.skip_reason(
        "ipc", {**FACTS, "device_count": 8, "ipc_engine": [False, "no zmq"]}, opts)


def test_a_benchmark_fails_without_a_positive_finite_ratio_or_byte_exact_bytes():
    ipc = {"ipc_vs_memcpy": 0.5, "verified": True, "ipc_gbps": 1.0, "transport": "shm"}
    assert accel_check.summarize("ipc", ipc)[:3] == ("pass", "ipc / memcpy", 0.5)
    assert accel_check.summarize("ipc", {**ipc, "verified": False})[0] == "fail"
    assert accel_check.summarize("offload", {"warm_ratio": float("nan")})[0] == "fail"
    assert accel_check.summarize("offload", {"warm_ratio": 0.0})[0] == "fail"
    assert accel_check.summarize("sync", {"runs": [{"ratio_vs_raw": 0.9}]})[:3] == ("pass", "raw broadcast / publish",
                                                                                    0.9)
    with pytest.raises(ValueError, match="no summary"):
        accel_check.summarize("tests", {})


def test_the_test_counts_come_from_pytests_last_summary_line():
    out = "tests/x.py::t PASSED\n==== 3 passed, 1 failed, 2 skipped, 1 error, 4 deselected in 12.5s ====\n"
    counts = accel_check.count_results(out)
    assert (counts["passed"], counts["failed"], counts["skipped"], counts["error"], counts["deselected"]) == (
        3, 1, 2, 1, 4)
    assert accel_check.count_results("1 passed in 0.1s\n")["passed"] == 1
    assert set(accel_check.count_results("killed while running\n").values()) == {0}
    # stopped before its summary (past its deadline): counted from -q's progress letters
    partial = accel_check.count_results("bringing up nodes...\n\n" + "." * 70 + "sF [ 57%]\n..E.\n")
    assert (partial["passed"], partial["skipped"], partial["failed"], partial["error"], partial["percent"]) == (
        73, 1, 1, 1, 57)


def test_the_lane_command_names_the_kind_and_the_plugin():
    argv = accel_check.lane_argv("npu-sim", accel_check.Options(tests=("tests/hal",), tests_k="offload", workers="2"))
    assert argv[1:5] == ["-m", "pytest", "tests/hal", "--hal-device"] and argv[5] == "npu-sim"
    assert ["-p", accel_check.MODULE] == argv[6:8] and argv[argv.index("-k") + 1] == "offload"
    assert argv[argv.index("-n") + 1] == "2"
    assert "-n" not in accel_check.lane_argv("cpu", accel_check.Options(workers="0"))


def test_default_sizes_follow_the_kind():
    assert accel_check.default_size_mb(host_memory=False, simulated=False) == 1024
    assert accel_check.default_size_mb(host_memory=True, simulated=False) == 64
    assert accel_check.default_size_mb(host_memory=False, simulated=True) == 64
    assert [accel_check.default_bucket_mb(s) for s in (2, 64, 1024, 4096)] == [1.0, 16.0, 256.0, 256.0]


def test_a_bad_command_line_or_option_is_refused():
    with pytest.raises(SystemExit):
        accel_check.parse_args(["--steps", "nope"])
    with pytest.raises(ValueError, match="budget_s"):
        accel_check.run_check(accel_check.Options(budget_s=0))
