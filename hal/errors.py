"""The one exception tree of the library (re-exported from the leaf module :mod:`devices.errors`).

Every error raised on purpose derives from :class:`HalError`, and also from the built-in exception a
caller would naturally catch (``ValueError`` for bad input, ``RuntimeError`` for an unusable device,
``TimeoutError`` for a peer that never answered), so existing ``except`` clauses keep working. The classes
are defined in :mod:`devices.errors` so that ``devices`` (which imports nothing from ``hal``) raises the
very same classes; these names are the public ones.
"""

from __future__ import annotations

from devices.errors import (
    DeviceIndexError,
    DeviceUnavailableError,
    DistributedTimeoutError,
    DuplicateDeviceError,
    HalError,
    UnknownDeviceError,
)

__all__ = ["HalError", "UnknownDeviceError", "DeviceUnavailableError", "DeviceIndexError", "DuplicateDeviceError",
           "DistributedTimeoutError"]
