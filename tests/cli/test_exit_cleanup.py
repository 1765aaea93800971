"""What ``hal sync``, ``hal launch`` and ``hal bench`` leave behind (issue 29): nothing under ``$TMPDIR`` after a
run, and, on Ctrl-C, exit status 130, one line on stderr, no process, directory or ``/dev/shm/hal-*`` segment left.

Each command runs as a user runs it: the console script in a subprocess with ``TMPDIR`` set to a fresh directory;
Ctrl-C is SIGINT to the command's whole process group, as a terminal sends it (:mod:`tests.cli.stopping`)."""

from __future__ import annotations

import pathlib
import signal
import subprocess
import textwrap

import pytest

from tests.cli.stopping import HAL, ROOT, hal_env, interrupt_hal, leftovers, said

pytestmark = [pytest.mark.multiprocess]

TINY_SYNC = ["sync", "--device", "cpu", "--model", "qwen2.5-tiny"]


@pytest.fixture
def tmpdir_env(tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict[str, str]]:
    """A fresh, empty ``$TMPDIR`` for the command, and its environment."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    return tmpdir, hal_env(tmpdir, tmp_path / "torch-cache")


def run_hal(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([*HAL, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(240)
def test_a_file_engine_run_removes_its_steps_and_the_agents_logs(tmpdir_env):
    tmpdir, env = tmpdir_env
    out = run_hal([*TINY_SYNC, "--engine", "file", "--rollouts", "1", "--steps", "1"], env, timeout=220)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "every step verified" in out.stdout
    assert leftovers(tmpdir) == []  # was: hal-sync-*/step-0000000{0,1}/..., torchelastic_*


@pytest.mark.timeout(240)
def test_a_file_root_the_user_gave_is_kept_and_named(tmpdir_env, tmp_path):
    tmpdir, env = tmpdir_env
    root = tmp_path / "steps"
    out = run_hal([*TINY_SYNC, "--engine", "file", "--rollouts", "1", "--steps", "1", "--file-root", str(root)],
                  env, timeout=220)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert sorted(p.name for p in root.iterdir()) == ["step-00000000", "step-00000001"]  # warm-up, step 1
    assert f"hal sync: the file engine's last steps are kept in {root} (--file-root)" in out.stderr.splitlines()
    assert leftovers(tmpdir) == []


@pytest.mark.timeout(180)
def test_launch_removes_the_elastic_agents_log_directory(tmpdir_env, tmp_path):
    tmpdir, env = tmpdir_env
    script = tmp_path / "job.py"
    script.write_text("import os, pathlib, sys\npathlib.Path(sys.argv[1], 'rank' + os.environ['RANK']).touch()\n")
    out = run_hal(["launch", "--device", "cpu", "--nproc-per-node", "2", "--", str(script), str(tmp_path)], env,
                  timeout=160)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "rank0").exists() and (tmp_path / "rank1").exists()
    assert leftovers(tmpdir) == []  # was: torchelastic_*/hal_*/attempt_0/{0,1}/


@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine", ["ipc", "file"])  # ipc: buckets in /dev/shm; file: a directory in $TMPDIR
def test_ctrl_c_ends_sync_with_status_130_one_line_and_nothing_left(tmpdir_env, engine):
    tmpdir, env = tmpdir_env
    stopped = interrupt_hal([*TINY_SYNC, "--engine", engine, "--rollouts", "2", "--steps", "1000", "--timeout", "60"],
                            env, said("hal sync: step 1/1000"), start_timeout=220)
    assert stopped.returncode == 130, stopped.transcript()
    assert stopped.after == ["hal: interrupted"], stopped.transcript()  # was: about 80 lines, SignalException, exit status 1
    assert "Traceback" not in stopped.before and stopped.stdout == ""
    assert len(stopped.started) >= 3  # the three ranks were running (and torch's resource tracker)
    assert stopped.survivors == []
    assert stopped.left_behind == set()
    assert leftovers(tmpdir) == []
    assert stopped.seconds < 30


def ranks_running(processes: list[tuple[int, str]]) -> int:
    """How many of ``processes`` are ranks (started by multiprocessing's spawn) running hal's code: past their
    interpreter's start, they catch SIGTERM (:func:`hal.apps.shutdown.quiet_rank_exit`). A rank still importing
    would print Python's own traceback for a Ctrl-C (the one case :mod:`hal.apps.shutdown` leaves)."""
    count = 0
    for pid, _ in processes:
        try:
            caught = int(next(line for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines()
                              if line.startswith("SigCgt:")).split()[1], 16)
            count += b"spawn_main" in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes() and \
                bool(caught >> (signal.SIGTERM - 1) & 1)
        except (OSError, StopIteration):
            pass
    return count


@pytest.mark.timeout(240)
def test_ctrl_c_ends_bench_with_status_130_one_line_and_nothing_left(tmpdir_env):
    tmpdir, env = tmpdir_env
    # the engine against broadcasts: two ranks for many rounds
    stopped = interrupt_hal(["bench", "--device", "cpu", "--only", "sync", "--size-mb", "8", "--bucket-mb", "1",
                             "--rounds", "1000"], env, lambda stderr, processes: ranks_running(processes) == 2,
                            start_timeout=200)
    assert stopped.returncode == 130, stopped.transcript()
    assert stopped.after == ["hal: interrupted"], stopped.transcript()
    assert "Traceback" not in stopped.before and stopped.stdout == ""
    assert stopped.survivors == []
    assert leftovers(tmpdir) == []


@pytest.mark.timeout(240)
def test_sigterm_ends_bench_with_status_143_one_line_and_nothing_left(tmpdir_env):
    """SIGTERM to hal bench alone (a process manager's stop; its ranks get no signal): the ranks are stopped and
    nothing is left (before, with no handler, hal bench died at once and left its ranks' directory)."""
    tmpdir, env = tmpdir_env
    stopped = interrupt_hal(["bench", "--device", "cpu", "--only", "sync", "--size-mb", "8", "--bucket-mb", "1",
                             "--rounds", "1000"], env, lambda stderr, processes: ranks_running(processes) == 2,
                            start_timeout=200, signum=signal.SIGTERM)
    assert stopped.returncode == 143, stopped.transcript()
    assert stopped.after == ["hal: stopped by SIGTERM"], stopped.transcript()
    assert "Traceback" not in stopped.before and stopped.stdout == ""
    assert stopped.survivors == []
    assert leftovers(tmpdir) == []


SLEEPER = textwrap.dedent("""\
    import os, signal, sys, time
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # the script's own choice: no traceback of its own
    print(f"rank {os.environ['RANK']} ready", file=sys.stderr, flush=True)
    time.sleep(300)
""")


@pytest.mark.timeout(180)
def test_ctrl_c_ends_launch_with_status_130_one_line_and_nothing_left(tmpdir_env, tmp_path):
    tmpdir, env = tmpdir_env
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    stopped = interrupt_hal(["launch", "--device", "cpu", "--nproc-per-node", "2", "--", str(script)], env,
                            lambda stderr, processes: "rank 0 ready" in stderr and "rank 1 ready" in stderr,
                            start_timeout=150)
    assert stopped.returncode == 130, stopped.transcript()
    assert [line for line in stopped.after if not line.endswith(" ready")] == ["hal: interrupted"], \
        stopped.transcript()
    assert stopped.after[-1] == "hal: interrupted" and "Traceback" not in stopped.before
    assert len(stopped.started) >= 2 and stopped.survivors == []
    assert leftovers(tmpdir) == []



@pytest.mark.timeout(300)
def test_a_sync_that_inherited_sigint_ignored_keeps_ignoring_it_in_its_ranks(tmpdir_env):
    """A job started in the background by a shell without job control inherits SIGINT ignored: the launcher
    ignored a process-group SIGINT while its ranks stopped, and it reported them failed (exit 2). Now the ranks
    ignore it too and the run completes."""
    import os
    import time

    tmpdir, env = tmpdir_env
    proc = subprocess.Popen([*HAL, *TINY_SYNC, "--rollouts", "1", "--steps", "3"], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    seen = []
    for line in proc.stderr:  # wait until the ranks run their steps, then Ctrl-C the whole group
        seen.append(line)
        if line.startswith("hal sync: step 1/3"):
            time.sleep(1.0)
            os.killpg(proc.pid, signal.SIGINT)
            break
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, "".join(seen) + stderr
    assert "every step verified" in stdout
    assert leftovers(tmpdir) == []
