"""Run the ``hal`` console script as a user does, stop it as Ctrl-C at a terminal does (SIGINT to its whole
process group), and collect what it leaves: its exit status, what it printed after the signal, the processes it
started that still live, the files under its ``$TMPDIR`` and the shared-memory segments ``/dev/shm/hal-*``.

A helper module of the tests in tests/cli and tests/ray_launcher (not a test module)."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Callable

ROOT = pathlib.Path(__file__).resolve().parents[2]
HAL_SCRIPT = pathlib.Path(sys.executable).with_name("hal")
HAL = [str(HAL_SCRIPT)] if HAL_SCRIPT.exists() else [sys.executable, "-m", "hal.apps.cli.main"]
PROGRESS = re.compile(r"^hal sync: step \d+/\d+$")
"""A progress line of ``hal sync`` where stderr is not a terminal (it may race the signal)."""
SHM = pathlib.Path("/dev/shm")


def hal_env(tmpdir: pathlib.Path, cache: pathlib.Path, **extra: str) -> dict[str, str]:
    """This process's environment with ``TMPDIR=tmpdir``, no ``HAL_DEVICE``, and torch's compile cache (a
    per-user cache that ``import transformers`` creates under ``$TMPDIR`` and every later run reuses: not the
    run's to remove) in ``cache``."""
    env = {k: v for k, v in os.environ.items() if k != "HAL_DEVICE"}
    env.update(TMPDIR=str(tmpdir), TORCHINDUCTOR_CACHE_DIR=str(cache), **extra)
    return env


def _stat(pid: int) -> list[str] | None:
    """Fields of ``/proc/<pid>/stat`` after the command name (state first, parent pid second); ``None``: gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(root: int) -> list[tuple[int, str]]:
    """Every live process below ``root`` (children, theirs, ...), as ``(pid, start time)`` (the start time tells
    a reused pid apart)."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None and fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append((int(entry), fields[19]))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child[0])
    return found


def still_running(processes: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Those of ``processes`` (from :func:`descendants`) alive now: same pid and start time, not a zombie (a
    zombie has ended; an orphan's is reaped by whoever adopted it)."""
    running = []
    for pid, start in processes:
        fields = _stat(pid)
        if fields is not None and fields[0] != "Z" and fields[19] == start:
            running.append((pid, start))
    return running


def hal_segments() -> set[str]:
    """Paths of the shared-memory segments ``/dev/shm/hal-*`` now (anyone's)."""
    return {str(p) for p in SHM.glob("hal-*")}


@dataclasses.dataclass
class Stopped:
    """What :func:`interrupt_hal` saw.

    Attributes:
        returncode: the exit status (130: ended by SIGINT through hal's own handling).
        before: stderr up to the signal; after: stderr from the signal on, one entry per non-empty line,
            progress lines (``hal sync: step k/n``) that raced the signal left out.
        stdout: everything on stdout.
        started: the processes below hal when it was signalled; survivors: those still running after it ended
            (given up to ``settle_s`` seconds).
        left_behind: paths of ``watch()`` (default: the ``/dev/shm/hal-*`` segments) that appeared during the run
            and were still there ``settle_s`` seconds after it (another process's could appear meanwhile: the
            run's are those it leaves behind).
        seconds: from the signal to the exit.
    """

    returncode: int
    before: str
    after: list[str]
    stdout: str
    started: list[tuple[int, str]]
    survivors: list[tuple[int, str]]
    left_behind: set[str]
    seconds: float

    def transcript(self) -> str:
        """What the command printed on stderr, the signal marked, for a failing assertion's message (the lines
        before the signal say what was running when it came)."""
        return f"{self.before[-4000:]}--- signal (exit status {self.returncode}) ---\n" + "\n".join(self.after)


def interrupt_hal(args: list[str], env: dict[str, str], ready: Callable[[str, list[tuple[int, str]]], bool],
                  start_timeout: float, stop_timeout: float = 60.0, settle_s: float = 10.0,
                  watch: Callable[[], set[str]] | None = None, signum: int = signal.SIGINT) -> Stopped:
    """Start ``hal *args`` in a session of its own, wait until ``ready(stderr so far, its descendants)`` (polled
    every 0.1 s, at most ``start_timeout`` s), send SIGINT to its process group (a terminal's Ctrl-C; any other
    ``signum`` goes to the hal process alone, as a process manager sends SIGTERM), and wait for it to end (at
    most ``stop_timeout`` s, then it is killed and the test fails).

    Raises:
        AssertionError: not ready within ``start_timeout`` (stderr included), or not ended within ``stop_timeout``.
    """
    watch = watch or hal_segments
    watched_before = watch()
    # SIGINT at its default, as a terminal's foreground job has it: pytest started as a background job of a
    # non-interactive shell (nohup ... &) inherits it ignored, and so would hal, which then never sees the Ctrl-C
    proc = subprocess.Popen([*HAL, *args], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    err: list[bytes] = []
    out: list[bytes] = []
    readers = [threading.Thread(target=lambda s=s, buf=buf: buf.extend(iter(s.readline, b"")), daemon=True)
               for s, buf in ((proc.stderr, err), (proc.stdout, out))]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + start_timeout
    try:
        while not ready(b"".join(err).decode(errors="replace"), descendants(proc.pid)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"hal {' '.join(args)} did not get ready (status {proc.poll()}):\n"
                                     + b"".join(err).decode(errors="replace")[-4000:])
            time.sleep(0.1)
        started, cut = descendants(proc.pid), len(err)
        watched_during = watch() - watched_before
        signalled = time.monotonic()
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signum)
        else:
            os.kill(proc.pid, signum)
        try:
            proc.wait(stop_timeout)
        except subprocess.TimeoutExpired:
            name = signal.Signals(signum).name
            raise AssertionError(f"hal {' '.join(args)} still runs {stop_timeout:g} s after {name}") from None
        seconds = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    until = time.monotonic() + settle_s
    while (still_running(started) or watch() & watched_during) and time.monotonic() < until:
        time.sleep(0.2)
    for reader in readers:
        reader.join(settle_s)  # EOF once every holder of the pipes (the resource tracker too) has exited
    after = [line.decode(errors="replace").rstrip() for line in err[cut:]]
    return Stopped(proc.returncode, b"".join(err[:cut]).decode(errors="replace"),
                   [line for line in after if line.strip() and not PROGRESS.match(line.strip())],
                   b"".join(out).decode(errors="replace"), started, still_running(started),
                   watch() & watched_during, seconds)


def said(text: str) -> Callable[[str, list[tuple[int, str]]], bool]:
    """A :func:`interrupt_hal` readiness test: ``text`` appeared on stderr."""
    return lambda stderr, processes: text in stderr


def leftovers(tmpdir: pathlib.Path) -> list[str]:
    """Everything under ``tmpdir``, as paths relative to it (sorted)."""
    return sorted(str(p.relative_to(tmpdir)) for p in tmpdir.rglob("*"))
