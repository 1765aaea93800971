"""The one exception tree of the library, in a leaf module that imports nothing of the project.

It lives in ``devices`` because ``devices`` imports nothing from ``hal`` and both raise these errors;
:mod:`hal.errors` re-exports every class unchanged (``hal.errors.HalError is devices.errors.HalError``),
and callers should keep using the ``hal`` names.

Every error raised on purpose derives from :class:`HalError`, and also from the built-in exception a
caller would naturally catch (``ValueError`` for bad input, ``RuntimeError`` for an unusable device,
``TimeoutError`` for a peer that never answered), so existing ``except`` clauses keep working.
"""

from __future__ import annotations


class HalError(Exception):
    """Base class of every error raised on purpose by hal, engines and ckpt."""


class UnknownDeviceError(HalError, ValueError):
    """A device kind was asked for that no built-in module nor ``hal.devices`` plugin provides.

    The message names the requested kind and lists the known ones.
    """


class DeviceUnavailableError(HalError, RuntimeError):
    """A known device kind was asked for but cannot be used in this process.

    The message names the kind, why it is unavailable (for npu: the text of the vendor package's import
    error) and which kinds are available instead.
    """


class DeviceIndexError(HalError, ValueError):
    """A device index outside the devices this process sees (``npu:5`` with two visible, ``LOCAL_RANK=3`` with
    one), or an index where one device is meant (another index than an engine's own device).

    The message names the index, where it came from (argument, ``HAL_DEVICE``, ``LOCAL_RANK``), how many
    devices the process sees and the visible-devices variable with its value.
    """


class DuplicateDeviceError(HalError, ValueError):
    """A device kind was registered under a name that is already taken."""


class DistributedTimeoutError(HalError, TimeoutError):
    """A rendezvous or collective did not complete within its timeout (a peer is missing or dead)."""
