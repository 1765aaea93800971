"""Errors raised by the engines, rooted in :class:`hal.errors.HalError`."""

from __future__ import annotations

from hal.errors import HalError


class OffloadError(HalError, ValueError):
    """An invalid request to :meth:`engines.BaseEngine.to` (``grad`` without ``model``, or a foreign device)."""


class EngineStateError(HalError, RuntimeError):
    """An engine was asked for what its state forbids (``train_step`` while offloaded or without an optimizer)."""
