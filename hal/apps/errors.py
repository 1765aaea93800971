"""Errors and argument checks shared by hal's applications; each error derives from :class:`hal.HalError` and
the built-in a caller would catch. ``hal.apps.cli.main`` prints a ``HalError`` as one line, exit status 2."""

from __future__ import annotations

import math
from typing import Any, Callable

from hal.errors import HalError


class UsageError(HalError, ValueError):
    """A command-line argument is wrong (a count below 1, an unknown name); the message names the flag."""


MIB = 1 << 20  # bytes in a MiB, the unit of every *-mb flag


def mib_to_bytes(mib: float, flag: str) -> int:
    """The bytes of a size given in MiB as ``flag`` (fractions allowed); UsageError unless finite and >= 1 byte."""
    if not 0 < mib < math.inf:  # NaN fails both comparisons
        raise UsageError(f"{flag} must be positive, got {mib} (a size in MiB)")
    if int(mib * MIB) < 1:
        raise UsageError(f"{flag} {mib} MiB is less than one byte")
    return int(mib * MIB)


class MissingFileError(HalError, FileNotFoundError):
    """A file named on the command line (a script, a model) does not exist."""


class MissingExtraError(HalError, ImportError):
    """An option needs an optional dependency that is not installed; the message says what to install."""


DISTRIBUTION = "hal-posttrain"  # distribution name, whose metadata lists the extras


def extra_requirements(extra: str) -> list[str]:
    """The requirements of hal's extra ``extra`` as pip takes them; ``[]`` when none or hal is not installed."""
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
    """Raise :class:`MissingExtraError` unless ``module`` imports; the message names ``what`` needs it and the pip
    command for ``extra``'s packages."""
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
    """One line for an elastic ``ProcessFailure``: the exception, the signal or the exit code."""
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
    ``role(rank)`` names a global rank."""
    first_rank, first = exc.get_first_failure()
    lines = [f"{command}: the {role(first_rank)} {describe_failure(first)}"]
    lines += [f"  then the {role(rank)} {describe_failure(failure)}"
              for rank, failure in sorted(exc.failures.items()) if rank != first_rank]
    return WorkerFailedError("\n".join(lines))
