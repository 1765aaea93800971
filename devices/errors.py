"""The one exception tree, in a leaf module so ``devices`` and ``hal`` raise the same classes (use ``hal.errors``).

Every error raised on purpose derives from :class:`HalError` and from the built-in exception a caller would
catch (ValueError, RuntimeError, TimeoutError).
"""

from __future__ import annotations


class HalError(Exception):
    """Base class of every error raised on purpose by hal, engines and ckpt."""


class UnknownDeviceError(HalError, ValueError):
    """A device kind no built-in module nor ``hal.devices`` plugin provides; the message lists the known ones."""


class DeviceUnavailableError(HalError, RuntimeError):
    """A known device kind that cannot be used in this process; the message says why and what is available."""


class DeviceIndexError(HalError, ValueError):
    """A device index this process has no device for, or another index than an engine's own device."""


class DuplicateDeviceError(HalError, ValueError):
    """A device kind was registered under a name that is already taken."""


class DistributedTimeoutError(HalError, TimeoutError):
    """A rendezvous or collective did not complete within its timeout (a peer is missing or dead)."""
