"""Errors and argument checks shared by hal's applications (the command line, the weight-sync job, the
benchmarks): a wrong argument, a missing file or extra, a failed worker process, and sizes in MiB.

Each error derives from :class:`hal.HalError` and from the built-in a caller would catch (``ValueError``,
``FileNotFoundError``, ``ImportError``, ``RuntimeError``). ``hal.apps.cli.main`` prints errors of the
``HalError`` tree as one line with exit status 2, no traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from hal.errors import HalError


class UsageError(HalError, ValueError):
    """A command-line argument is wrong (a count below 1, an unknown name); the message names the flag."""


MIB = 1 << 20
"""Bytes in a MiB: the unit of every ``*-mb`` size flag (``--bucket-mb``, ``--size-mb``)."""


def mib_to_bytes(mib: float, flag: str) -> int:
    """The bytes of a size given in MiB as ``flag`` (fractions allowed: 0.5 is 524288 bytes).

    Raises:
        UsageError: ``mib`` is not a finite positive number, or is under one byte; names the flag and value.
    """
    if not 0 < mib < math.inf:  # NaN fails both comparisons
        raise UsageError(f"{flag} must be positive, got {mib} (a size in MiB)")
    if int(mib * MIB) < 1:
        raise UsageError(f"{flag} {mib} MiB is less than one byte")
    return int(mib * MIB)


class MissingFileError(HalError, FileNotFoundError):
    """A file named on the command line (a script, a model) does not exist."""


class MissingExtraError(HalError, ImportError):
    """An option needs an optional dependency that is not installed; the message says what to install."""


DISTRIBUTION = "hal-posttrain"
"""hal's distribution name (``pyproject.toml``), whose metadata lists each extra's requirements."""


def extra_requirements(extra: str) -> list[str]:
    """The requirements of hal's optional extra ``extra`` as pip takes them (e.g. ``["ray==2.60.0"]`` for
    ``ray``), read from the installed distribution's metadata; ``[]`` when it lists none or hal is not installed."""
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        lines = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return []
    wanted = []
    for line in lines:
        req = Requirement(line)
        if req.marker is not None and req.marker.evaluate({"extra": extra}) and \
                not req.marker.evaluate({"extra": ""}):
            wanted.append(str(Requirement(f"{req.name}{req.specifier}")))
    return wanted


def require_extra(module: str, extra: str, what: str) -> None:
    """Raise :class:`MissingExtraError` unless ``module`` can be imported; checked before any work starts.

    Args:
        module: the import name (``"matplotlib"``).
        extra: hal's extra that holds it (``"plot"``); its requirements make the pip command of the message.
        what: what needs it, as the user asked for it (``"--plot"``).

    Raises:
        MissingExtraError: e.g. ``"--plot needs matplotlib, which is not installed here: pip install
            matplotlib (hal's 'plot' extra)"``. The command names the packages, not ``'.[plot]'``, which
            would reinstall hal itself over an editable install.
    """
    import importlib.util

    if importlib.util.find_spec(module) is None:
        packages = " ".join(f"'{r}'" if any(c in r for c in "<>=!;") else r for r in extra_requirements(extra))
        raise MissingExtraError(f"{what} needs {module}, which is not installed here: pip install "
                                f"{packages or module} (hal's '{extra}' extra)")


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
