"""Errors of the ``hal`` command line: a wrong argument, a missing file or extra, a failed worker process;
exit status 2, no traceback.

Each derives from :class:`hal.HalError` and from the built-in a caller would catch (``ValueError``,
``FileNotFoundError``, ``ImportError``). ``hal.apps.cli.main`` prints errors of the ``HalError`` tree as one
line; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from typing import Any, Callable

# the usage error and MiB sizes live in hal.apps.options (the benchmarks check sizes too); re-exported here
from hal.apps.options import MIB as MIB, UsageError as UsageError, mib_to_bytes as mib_to_bytes
from hal.errors import HalError


class MissingFileError(HalError, FileNotFoundError):
    """A file named on the command line (a script, a model) does not exist."""


class MissingExtraError(HalError, ImportError):
    """An option needs an optional dependency that is not installed; the message says what to install."""


class WorkerFailedError(HalError, RuntimeError):
    """A process the command started (a trainer or rollout rank) failed; the message names it and how."""


# Exit status -9: SIGKILL. Nothing in hal sends it, so it almost always comes from the kernel's
# out-of-memory killer (``dmesg`` shows "Out of memory: Killed process").
_OOM_HINT = ("SIGKILL from outside the job is usually the kernel's out-of-memory killer: free memory, or pick a "
             "smaller model (e.g. --model qwen2.5-tiny)")


def describe_failure(failure: Any) -> str:
    """One line for a ``torch.distributed.elastic`` ``ProcessFailure``: the exception, the signal or the exit code.

    ``failure.message`` is the dict the worker's error handler wrote (its ``"message"`` key holds
    ``"ExcType: text"``), a ``"Signal N (NAME) received by PID P"`` string, or torch's generic pointer to
    its docs when the worker left no error file; only the first two say anything, so the third is dropped.
    """
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    message = str(message or "").strip()
    if message.startswith("To enable traceback"):
        message = ""
    if failure.exitcode < 0:
        how = f"was killed by {failure.signal_name()}"
        if failure.signal_name() == "SIGKILL":
            how += f" ({_OOM_HINT})"
        return how
    how = f"exited with code {failure.exitcode}"
    return f"{how}: {message.splitlines()[-1]}" if message else how


def worker_failed(exc: Any, role: Callable[[int], str], command: str) -> WorkerFailedError:
    """A :class:`WorkerFailedError` for a ``ChildFailedError``: the first rank to fail first, then the rest.

    ``role(rank)`` names a global rank (``"trainer (rank 0)"``); the others usually fail only because their
    peer went away, so they follow on one line each.
    """
    first_rank, first = exc.get_first_failure()
    lines = [f"{command}: the {role(first_rank)} {describe_failure(first)}"]
    lines += [f"  then the {role(rank)} {describe_failure(failure)}"
              for rank, failure in sorted(exc.failures.items()) if rank != first_rank]
    return WorkerFailedError("\n".join(lines))
