"""What the command line and the benchmarks share about arguments: the usage error and sizes in MiB.

Both ``hal.apps.cli`` (which parses flags) and ``hal.apps.benchmarks`` (which checks the sizes it is given)
import it, so neither imports the other for it.
"""

from __future__ import annotations

import math

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
