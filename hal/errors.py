"""The one exception tree (defined in :mod:`devices.errors` so ``devices`` raises the same classes).

Every error raised on purpose derives from :class:`HalError` and from the built-in exception a caller would
catch (ValueError, RuntimeError, TimeoutError).
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
