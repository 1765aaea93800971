"""``hal soak`` as a user runs it: bad flags refused in one line before anything starts, ``--json`` per run, and a
failed run's seed and replay command on stderr with exit status 1 (the colocated engine: one process, seconds)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]


def hal_soak(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HAL_DEVICE"}
    return subprocess.run([sys.executable, "-m", "hal.apps.cli.main", "soak", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.parametrize("args, error", [
    (["--updates", "0"], "hal: error: --updates must be positive, got 0"),
    (["--fault-rate", "1.5"], "hal: error: --fault-rate must be a probability in [0, 1], got 1.5"),
    (["--bucket-mb", "0"], "hal: error: --bucket-mb must be positive, got 0.0 (a size in MiB)"),
    (["--device", "cpu", "--engine", "kimi"], "hal: error: --engine kimi is unavailable on cpu: Kimi's"),
])
def test_bad_flags_are_refused_in_one_line(args, error):
    out = hal_soak(*args, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(error), out.stderr
    assert out.stdout == "" and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.timeout(300)
def test_json_per_run_and_a_flip_skipped_on_the_full_format_with_the_reason():
    pytest.importorskip("transformers")
    out = hal_soak("--device", "cpu", "--engine", "colocated", "--wire-format", "delta", "full", "--updates", "6",
                   "--faults", "flip", "--fault-rate", "1", "--json")
    reports = json.loads(out.stdout)
    delta, full = reports
    assert (delta["engine"], delta["wire_format"], delta["seed"], full["wire_format"]) == ("colocated", "delta", 0, "full")
    # updates 3 and 5 get a flip (never the first two, nor one right after a fault)
    assert delta["ok"] is True and delta["faults"] == {"flip": 2} and delta["outcomes"] == {"error": 2, "absorbed": 0}
    assert delta["wrong_bytes_served"] == 0 and delta["updates_ok"] == 4
    assert delta["skipped"] == {}  # only flips were asked for, and the colocated engine takes them
    # the full wire format carries no checksum a rollout could check first: the flip is skipped, saying why
    assert full["ok"] is True and full["faults"] == {} and full["updates_ok"] == 6
    assert full["skipped"]["flip"].startswith("the full wire format carries no checksum")
    assert out.returncode == 0, out.stderr[-2000:]


def test_a_failed_run_prints_its_seed_and_replay_command_and_exits_1(monkeypatch, capsys):
    from hal.apps.cli import soak as cli
    from hal.apps.soak import run as soak_run
    from tests.apps.soak.histories import clean, history, run_of
    from hal.apps.soak.checker import judge

    bad = clean(12)
    bad.observed[2]["sums"]["b"] = "deadbeef"
    report = judge(history(run_of(u12=bad)), 2)
    monkeypatch.setattr(soak_run, "soak", lambda options, progress=None: report)
    status = cli.run(cli.Soak(device="cpu", engine=("collective",), seed=(4,), updates=30))
    err = capsys.readouterr().err
    assert status == 1
    assert "hal soak: collective (full) on cpu, seed 4: 1 failure(s)" in err
    assert "  replay: hal soak --device cpu --engine collective --seed 4 --updates 12" in err.splitlines()


@pytest.mark.timeout(300)
def test_sigterm_stops_the_workers_and_leaves_nothing_behind(tmp_path):
    pytest.importorskip("transformers")
    import signal
    import time

    env = {k: v for k, v in os.environ.items() if k != "HAL_DEVICE"}
    env["TMPDIR"] = str(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "hal.apps.cli.main", "soak", "--device", "cpu", "--engine", "file",
                             "--updates", "1000", "--fault-rate", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        first = proc.stderr.readline()
        assert first.startswith("hal soak: file (full) on cpu, seed 0, 1000 updates"), first
        assert proc.stderr.readline().startswith("hal soak:   update 100/1000")  # the workers run updates
        workers = [p for p in os.listdir("/proc") if p.isdigit() and _child_of(int(p), proc.pid)]
        assert len(workers) >= 3  # the trainer and two rollouts
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == "hal: stopped by SIGTERM"
    assert time.monotonic() - start < 30  # the workers stopped within their exit wait (10 s) and a margin
    assert [p for p in tmp_path.iterdir() if not p.name.startswith("torchinductor_")] == []
    assert [w for w in workers if os.path.exists(f"/proc/{w}")] == []


def _child_of(pid: int, parent: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1]) == parent
    except (OSError, ValueError, IndexError):
        return False


def test_the_table_prints_every_cell_whole_with_the_verdict_last(capsys):
    # 15 columns needed more than the 132 the console was held to: a new user read "y…" for the verdict
    from hal.apps.cli import soak as cli
    from hal.apps.soak.checker import judge
    from tests.apps.soak.histories import clean, history, run_of

    bad = clean(12)
    bad.observed[2]["sums"]["b"] = "deadbeef"
    reports = [judge(history(run_of()), 2), judge(history(run_of(u12=bad)), 2)]
    cli.print_table(reports)
    out = capsys.readouterr().out
    assert "…" not in out
    header = next(line for line in out.splitlines() if "misrep/unrep" in line)
    assert header.split("┃")[-2].strip() == "ok" and "held + KiB" in header
    rows = [line for line in out.splitlines() if line.startswith("│ collective")]
    assert [row.split("│")[-2].strip() for row in rows] == ["yes", "NO"]
