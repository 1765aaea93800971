"""Errors raised by the engines, rooted in :class:`hal.errors.HalError`."""

from __future__ import annotations

from hal.errors import HalError


class OffloadError(HalError, ValueError):
    """An invalid request to :meth:`engines.BaseEngine.to`.

    Raised for ``grad=True, model=False`` (gradient buffers move only with the model, the upstream verl
    rule) and for a target device that is neither ``"cpu"`` nor the engine's own kind. The message names the
    bad value and what is accepted.
    """


class EngineStateError(HalError, RuntimeError):
    """An engine was asked to do something its current state forbids.

    Examples: :meth:`engines.BaseEngine.train_step` while parameters or optimizer states are offloaded,
    or on an engine built without an optimizer. The message says which part is where and what to call.
    """
