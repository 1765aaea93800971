"""How hal's commands end: what they leave behind, and what a signal does to them.

* Temporary directories (:func:`scratch_dir`): every directory a command makes for itself (the file engine's
  steps, vLLM's start-up model, torch.distributed.elastic's logs) is removed when the command ends, whether it
  succeeds, fails or is interrupted. A directory the user named (``hal sync --file-root DIR``) is the user's,
  and kept.
* torch.distributed.elastic's logs (:func:`elastic_logs`): without a directory of its own the elastic agent
  makes ``$TMPDIR/torchelastic_*`` and never removes it; hal gives it one of its scratch directories. A rank's
  error file is read into ``ChildFailedError`` before the launcher returns, so nothing is lost with it.
* Signals, in the launching process (:func:`interrupted_status`, :func:`own_elastic_launch`,
  :func:`stop_on_signals`): SIGINT (Ctrl-C) ends a command with status 130 and one line on stderr
  (``hal.apps.cli.main``), once its ``finally`` blocks have stopped what it started; so does SIGTERM while
  torch.distributed.elastic's agent runs or ``hal bench`` / ``hal soak`` run their processes (status 143; under
  Ray, Ray's driver turns SIGTERM into ``sys.exit(15)``, which runs the same ``finally`` blocks).
* Signals, in a rank hal launched (:func:`quiet_rank_exit`): SIGINT and SIGTERM end the rank without a word,
  its ``finally`` blocks and exit handlers run, and a rank stuck in a call that does not return to Python ends
  at the latest ``grace`` seconds later.

Ctrl-C at a terminal signals the whole foreground process group: the launcher and every rank at once. Left
out: a process still starting its interpreter and imports (``hal`` itself in its first seconds, a rank in
its first second or two) prints Python's own ``KeyboardInterrupt`` traceback before any of hal's code runs
in it (a blocked signal mask does not survive multiprocessing's spawn, and ignoring SIGINT in the launcher
would ignore Ctrl-C).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Any, Iterator

RANK_EXIT_GRACE_S = 3.0
"""Seconds a launched rank has, after SIGINT or SIGTERM, to unwind before it exits without cleaning up."""
LAUNCH_SHUTDOWN_TIMEOUT_S = 15
"""Seconds torch.distributed.elastic's agent waits for hal's own ranks to exit after it signalled them, before
SIGKILL (ranks exit within :data:`RANK_EXIT_GRACE_S`; torch's default is 30)."""
OWN_LAUNCH_SIGNALS = "SIGTERM,SIGHUP,SIGQUIT"
"""The ``signals_to_handle`` of hal's own elastic launches: torch's default less SIGINT, which stays a
``KeyboardInterrupt`` (the agent then stops the ranks with SIGTERM, see :func:`own_elastic_launch`)."""
_AGENT_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
_RANK_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[str]:
    """A new directory ``$TMPDIR/<prefix>XXXXXXXX`` for the ``with`` block, removed with its content when the
    block ends (normally, by an exception, or by ``KeyboardInterrupt``).

    Raises:
        OSError: the directory cannot be created (the temporary directory is missing or not writable).
    """
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def elastic_logs(log_dir: str) -> Any:
    """torch.distributed.elastic's ``LogsSpecs`` writing under ``log_dir`` (a :func:`scratch_dir`), for a
    ``LaunchConfig`` (``logs_specs=``); without it the agent makes ``$TMPDIR/torchelastic_*`` and leaves it."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    return DefaultLogsSpecs(log_dir=log_dir)


def interrupted_status(exc: BaseException) -> int | None:
    """The exit status of a command that ``exc`` ended by a signal: 130 for ``KeyboardInterrupt`` (SIGINT),
    128 + the signal number for torch.distributed.elastic's ``SignalException`` (its agent raises it for the
    signals it handles: SIGTERM, SIGHUP, SIGQUIT, and SIGINT under ``hal launch``); ``None`` for any other."""
    if isinstance(exc, KeyboardInterrupt):
        return 128 + signal.SIGINT
    sigval = getattr(exc, "sigval", None)
    if type(exc).__name__ == "SignalException" and sigval is not None:
        return 128 + int(sigval)
    return None


@contextlib.contextmanager
def stop_on_signals(command: str) -> Iterator[None]:
    """While the block runs, SIGTERM and SIGHUP raise torch.distributed.elastic's ``SignalException`` in this
    process (the main thread), as they do while ``hal sync``'s elastic agent runs: the command's ``finally``
    blocks stop the processes it started and remove what it made, and ``hal`` reports ``stopped by SIGTERM``
    with status 143 (:func:`interrupted_status`). A signal ignored when the block starts stays ignored; the
    handlers found are put back after it. Off the main thread (where Python cannot set handlers) it does
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def raise_signal(signum: int, frame: Any) -> None:
        raise SignalException(f"{command} got {signal.Signals(signum).name}", sigval=signal.Signals(signum))

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    for sig, handler in saved.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, raise_signal)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:  # None: installed outside Python, cannot be put back
                signal.signal(sig, handler)


@contextlib.contextmanager
def own_elastic_launch(scratch: str | None = None) -> Iterator[None]:
    """The setting of an elastic launch by hal (``hal sync``, ``hal bench``, ``hal launch``).

    * With ``scratch`` (the launch's own directory, :func:`scratch_dir`), this process's temporary files go
      there while the launch runs: torch's ``start_processes`` names one ``pytorch-errorfile-*.pickle`` per rank
      in the temporary directory, a rank that raises writes it, and nothing removes it (one was left in
      ``/tmp`` per failed or interrupted launch); under ``scratch`` it goes with the directory.

    * torch.distributed.elastic's warnings are muted: they narrate the agent's shutdown (``Received 2 death
      signal, shutting down workers``); hal reports a failed rank itself (the agent's errors still print) and
      an interrupt in one line.
    * The handlers the agent installs for the signals it handles (raising its ``SignalException``, an
      ``Exception``) are replaced by those found before, so a later signal is not swallowed by an
      ``except Exception``.

    hal's own launches also pass :data:`OWN_LAUNCH_SIGNALS` as ``signals_to_handle``: SIGINT then stays a
    ``KeyboardInterrupt`` in this process, and the agent, stopped by it, sends the ranks SIGTERM rather than
    forwarding SIGINT (a rank still importing would print a traceback for SIGINT; SIGTERM ends it silently).
    Their ranks call :func:`quiet_rank_exit` first. A rank still starting when a terminal's Ctrl-C reaches the
    whole process group is the one case left: Python's own ``KeyboardInterrupt`` traceback from its imports.
    """
    import torch.distributed.launcher.api  # noqa: F401 - creates the elastic loggers muted below

    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher"))]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(max(logger.level, logging.ERROR))
    saved = {name: signal.getsignal(getattr(signal, name)) for name in _AGENT_SIGNALS if hasattr(signal, name)} \
        if threading.current_thread() is threading.main_thread() else {}
    tempdir = tempfile.tempdir
    if scratch is not None:
        tempfile.tempdir = scratch
    try:
        yield
    finally:
        tempfile.tempdir = tempdir
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        for name, handler in saved.items():
            if handler is not None:  # None: installed outside Python, cannot be put back
                signal.signal(getattr(signal, name), handler)


def quiet_rank_exit(grace: float = RANK_EXIT_GRACE_S) -> None:
    """In a rank hal launched: SIGINT and SIGTERM end this process with status 128 + the signal number, quietly.

    The first of them raises ``SystemExit`` in the main thread (``finally`` blocks, context managers and exit
    handlers run, so engines free their shared memory), makes further ones ignored, and points stderr at
    ``/dev/null``: the rank's peers fail as it leaves, and what they or torch's C++ would print about it is
    noise, since the launcher reports the interrupt in one line. A rank blocked in a call that does not return
    to Python (a store read, a collective) cannot run the handler: a watcher thread, woken through
    ``signal.set_wakeup_fd``, ends the process with ``os._exit`` ``grace`` seconds (wall clock) after the
    signal. torch's spawn makes SIGINT the rank's parent-death signal, so a rank whose launcher died ends the
    same way.

    A signal the process inherited as ignored stays ignored (the launcher ignores it too). Does nothing outside
    the main thread (signal handlers cannot be set there).

    Raises:
        ValueError: ``grace`` is not positive.
    """
    if not grace > 0:
        raise ValueError(f"grace must be positive seconds, got {grace}")
    if threading.current_thread() is not threading.main_thread():
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)

    def on_signal(signum: int, frame: Any) -> None:
        for sig in _RANK_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        _silence_stderr()
        # the exit may go through an asyncio task, which keeps it and logs "Task exception was never retrieved"
        logging.getLogger("asyncio").setLevel(logging.CRITICAL + 1)
        raise SystemExit(128 + signum)

    threading.Thread(target=_exit_after, args=(read_fd, grace), name="hal-rank-exit", daemon=True).start()
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    for sig in _RANK_SIGNALS:
        # a signal this process inherited as ignored (a job started in the background by a shell without job
        # control, nohup) stays ignored, as it is in the launcher: else the ranks stopped and the launcher,
        # which ignores it, reported them failed
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, on_signal)


def _silence_stderr() -> None:
    """Point file descriptor 2 (``sys.stderr``'s and C++'s) at ``/dev/null``."""
    with contextlib.suppress(OSError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)


def _exit_after(read_fd: int, grace: float) -> None:
    """The watcher of :func:`quiet_rank_exit`: on SIGINT or SIGTERM, silence stderr at once (the main thread may
    be stuck in C++, which logs there when its peers go), then ``os._exit(128 + n)`` after ``grace`` seconds."""
    while True:
        try:
            got = os.read(read_fd, 64)
        except OSError:
            return
        if not got:
            return
        for signum in got:
            if signum in _RANK_SIGNALS:
                _silence_stderr()
                time.sleep(grace)
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                os._exit(128 + signum)


__all__ = ["LAUNCH_SHUTDOWN_TIMEOUT_S", "OWN_LAUNCH_SIGNALS", "RANK_EXIT_GRACE_S", "elastic_logs",
           "interrupted_status", "own_elastic_launch", "quiet_rank_exit", "scratch_dir"]
