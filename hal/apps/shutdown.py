"""How hal's commands end: what they leave behind, and what a signal does to them.

* Temporary directories (:func:`scratch_dir`) a command makes are removed when it ends, however it ends; a
  directory the user named (``--file-root DIR``) is kept. torch.distributed.elastic's logs go in one
  (:func:`elastic_logs`).
* In the launching process, SIGINT ends a command with status 130 and one line on stderr once its ``finally``
  blocks ran; so does SIGTERM (143) while an elastic agent or ``hal bench`` / ``hal soak`` runs processes.
* In a rank hal launched (:func:`quiet_rank_exit`), SIGINT and SIGTERM end it quietly, ``finally`` blocks
  run, and a rank stuck outside Python ends ``grace`` seconds later.

Left out: a process still importing when Ctrl-C reaches the process group prints Python's own traceback.
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

# Seconds a launched rank has, after SIGINT or SIGTERM, to unwind before it exits without cleaning up.
RANK_EXIT_GRACE_S = 3.0
# Seconds the elastic agent waits for hal's ranks after signalling them, before SIGKILL (torch's default: 30).
LAUNCH_SHUTDOWN_TIMEOUT_S = 15
# signals_to_handle of hal's elastic launches: torch's default less SIGINT, which stays a KeyboardInterrupt.
OWN_LAUNCH_SIGNALS = "SIGTERM,SIGHUP,SIGQUIT"
_AGENT_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
_RANK_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[str]:
    """A new directory ``$TMPDIR/<prefix>XXXXXXXX`` for the ``with`` block, removed with its content however it ends."""
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def elastic_logs(log_dir: str) -> Any:
    """torch.distributed.elastic's ``LogsSpecs`` writing under ``log_dir``, for a ``LaunchConfig``."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    return DefaultLogsSpecs(log_dir=log_dir)


def interrupted_status(exc: BaseException) -> int | None:
    """The exit status of a command ended by signal ``exc``: 130 for ``KeyboardInterrupt``, 128 + the number for
    elastic's ``SignalException``; ``None`` for any other."""
    if isinstance(exc, KeyboardInterrupt):
        return 128 + signal.SIGINT
    sigval = getattr(exc, "sigval", None)
    if type(exc).__name__ == "SignalException" and sigval is not None:
        return 128 + int(sigval)
    return None


@contextlib.contextmanager
def stop_on_signals(command: str) -> Iterator[None]:
    """While the block runs, SIGTERM and SIGHUP raise elastic's ``SignalException`` (status 143); off the main
    thread it does nothing."""
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
    """Set up an elastic launch by hal: temporary files under ``scratch``, elastic's warnings muted, the signal
    handlers found before put back after the agent installs its own."""
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

    The first raises ``SystemExit`` in the main thread (``finally`` blocks run) and points stderr at
    ``/dev/null``; a watcher thread ends a rank stuck outside Python with ``os._exit`` ``grace`` seconds later.
    A signal inherited as ignored stays ignored. Does nothing outside the main thread.
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
        # a signal inherited as ignored (nohup, a shell without job control) stays ignored, as in the launcher
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, on_signal)


def _silence_stderr() -> None:
    with contextlib.suppress(OSError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)


def _exit_after(read_fd: int, grace: float) -> None:
    """Watch for SIGINT or SIGTERM: silence stderr at once, then ``os._exit(128 + n)`` after ``grace`` seconds."""
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
