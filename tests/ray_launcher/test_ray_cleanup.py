"""The Ray launcher's ends (issue 29): an address nothing answers on is one ``hal: error:`` line within a bounded
time; a long ``$TMPDIR`` does not break the one-node cluster (Ray's Unix sockets are limited to 107 bytes);
Ctrl-C on ``hal sync --launcher ray`` exits 130 with one line and leaves no process or directory."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import tempfile
import time

import pytest

from tests.cli.stopping import HAL, ROOT, hal_env, hal_segments, interrupt_hal, leftovers, said
from tests.ray_launcher.conftest import ray, ray_cluster

import hal.ray

pytestmark = [pytest.mark.multiprocess]

RAY_SYNC = ["sync", "--launcher", "ray", "--device", "cpu", "--model", "qwen2.5-tiny", "--rollouts", "1"]


def long_dir(base: pathlib.Path, length: int = 120) -> pathlib.Path:
    """A new directory under ``base`` whose path is ``length`` characters long."""
    path = base / ("t" * (length - len(str(base)) - 1))
    path.mkdir()
    assert len(str(path)) == length
    return path


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


@pytest.mark.timeout(120)
def test_a_closed_port_is_one_error_line_at_once(tmp_path):
    with socket.socket() as s:  # a port of this host that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    begin = time.monotonic()
    out = subprocess.run([*HAL, *RAY_SYNC, "--steps", "1", "--address", f"127.0.0.1:{port}"], capture_output=True,
                         text=True, timeout=100, cwd=ROOT, env=hal_env(tmp_path, tmp_path / "torch-cache"))
    assert out.returncode == 2, out.stderr[-3000:]
    assert error_lines(out.stderr) == [  # was: Ray's C++ log every 5-30 s for 12 minutes, then a traceback
        f"hal: error: cannot reach the Ray cluster at 127.0.0.1:{port}: connection refused (nothing listens on that "
        f"port); check that the cluster's head runs there ('ray start --head' on it; 'ray status' there prints the "
        f"address to pass) and that this machine can reach it"]
    assert time.monotonic() - begin < 60


@pytest.mark.timeout(120)
def test_a_port_that_accepts_but_is_no_ray_head_fails_in_bounded_time_in_one_line(tmp_path):
    with socket.socket() as s:  # accepts connections (the kernel's backlog) and never answers
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        port = s.getsockname()[1]
        begin = time.monotonic()
        out = subprocess.run([*HAL, *RAY_SYNC, "--steps", "1", "--address", f"127.0.0.1:{port}"],
                             capture_output=True, text=True, timeout=100, cwd=ROOT,
                             env=hal_env(tmp_path, tmp_path / "torch-cache"))
        seconds = time.monotonic() - begin
    assert out.returncode == 2, out.stderr[-3000:]
    lines = error_lines(out.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"hal: error: cannot connect to the Ray cluster at 127.0.0.1:{port}: "
                                                   f"ConnectionError: "), lines
    # TCP opens, then one attempt of Ray's client: its 5 s connect and subscribe waits, then 10 s
    assert seconds < hal.ray.CONNECT_TIMEOUT_S + 45


@pytest.mark.timeout(30)
def test_ray_gets_a_short_temporary_directory_under_a_long_tmpdir(tmp_path):
    assert hal.ray.ray_temp_parent("/tmp") == "/tmp"  # short enough: kept
    assert hal.ray.ray_temp_parent(str(long_dir(tmp_path))) == "/tmp"


@pytest.mark.timeout(200)
def test_a_one_node_cluster_starts_under_a_120_character_tmpdir_and_leaves_it_empty(tmp_path, monkeypatch):
    tmpdir = long_dir(tmp_path)
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile reads TMPDIR again
    assert tempfile.gettempdir() == str(tmpdir)
    with ray_cluster(num_cpus=1) as node:  # was: "AF_UNIX path length cannot exceed 107 bytes"
        temp_dir = node.temp_dir
        assert os.path.dirname(temp_dir) == "/tmp" and len(temp_dir) <= 40  # LocalCluster's documented bound
        assert ray.get(ray.remote(lambda: 6 * 7).options(num_cpus=0).remote(), timeout=60) == 42
    assert not os.path.exists(temp_dir)
    assert leftovers(tmpdir) == []


def own_ray_dirs(tmpdir: pathlib.Path) -> tuple[set[str], object]:
    """A watch of the Ray folders of the processes run with ``TMPDIR=tmpdir`` (this run's, not another xdist
    worker's): each is noted while its process lives and reported while it exists."""
    seen: set[str] = set()
    marker = f"TMPDIR={tmpdir}".encode()

    def watch() -> set[str]:
        for entry in os.listdir("/proc"):
            try:
                environ = pathlib.Path(f"/proc/{entry}/environ").read_bytes()
                cmdline = pathlib.Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if marker in environ.split(b"\0"):
                seen.update(a.split(b"=", 1)[1].decode() for a in cmdline if a.startswith(b"--temp-dir=/tmp/hal-ray-"))
        return hal_segments() | {d for d in seen if os.path.exists(d)}
    return seen, watch


@pytest.mark.timeout(300)
def test_ctrl_c_ends_sync_on_ray_with_status_130_one_line_and_nothing_left(tmp_path):
    tmpdir = long_dir(tmp_path)  # the one-node cluster's sockets need a short directory of their own
    seen, watch = own_ray_dirs(tmpdir)  # /tmp/hal-ray-* of this run only: other workers run Ray tests too
    stopped = interrupt_hal([*RAY_SYNC, "--steps", "1000", "--timeout", "60"], hal_env(tmpdir, tmp_path / "cache"),
                            said("hal sync: step 1/1000"), start_timeout=240, watch=watch)
    assert len(seen) == 1, seen  # the run's own cluster folder was found, so the check below can fail
    assert stopped.returncode == 130, stopped.transcript()
    assert stopped.after == ["hal: interrupted"], stopped.transcript()  # was: a traceback ending in "ImportError: sys.meta_path is None"
    assert "Connecting to existing Ray cluster" not in stopped.before, stopped.transcript()  # hal's own node
    assert "Traceback" not in stopped.before and stopped.stdout == ""
    assert len(stopped.started) >= 4  # ray start, its GCS and raylet, the workers
    assert stopped.survivors == []
    assert stopped.left_behind == set()  # the cluster's directory under /tmp, and shared memory
    assert leftovers(tmpdir) == []
