"""The fast lane (``pytest -n auto -m "not slow"``, README) leaves out rank groups, other frameworks' code, tests
that declare a longer timeout and those marked ``slow``; it keeps the rest (tests/conftest.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fast_lane(*paths: str) -> set[str]:
    """The node ids ``-m "not slow"`` selects among ``paths`` (collection only)."""
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist", "-m", "not slow",
                          *paths], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    return {line.strip() for line in run.stdout.splitlines() if "::" in line}


def test_the_fast_lane_leaves_out_rank_groups_other_frameworks_and_long_tests():
    selected = fast_lane("tests/apps/test_multiprocess.py", "tests/interop/test_verl_sim.py", "tests/test_readme.py",
                         "tests/ckpt/test_collective_multiprocess.py")
    names = {nodeid.split("::")[-1].split("[")[0] for nodeid in selected}
    assert "test_results_larger_than_a_pipe_buffer_come_back" in names  # quick: kept
    assert "test_a_group_past_its_deadline_raises_with_every_running_ranks_stacks" not in names  # marked slow
    assert not any(n.startswith("tests/interop/") for n in selected)  # interop
    assert not any(n.startswith("tests/ckpt/test_collective_multiprocess.py") for n in selected)  # multiprocess
    assert "test_a_run_block_runs_as_written_and_leaves_nothing_behind" not in names  # timeout above the default
