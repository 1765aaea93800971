"""Errors of delta weight sync (one tree with ``ckpt``'s: a refused update is a :class:`WeightMismatchError`)."""

from __future__ import annotations

from ckpt.errors import WeightMismatchError


class DeltaRefusedError(WeightMismatchError):
    """A rollout refused a ``delta_flush`` update; it needs a full seed next (``DeltaSender.reseed()``).

    Atomic: nothing of the update is served; in place: the rollout is degraded. ``tensor`` names the tensor
    refused (``None``: the flush as a whole), ``step`` the step the update would have produced.
    """

    def __init__(self, message: str, tensor: str | None = None, step: int | None = None) -> None:
        self.tensor, self.step = tensor, step
        super().__init__(message)


class DeltaChecksumError(DeltaRefusedError):
    """A flush's bytes or a tensor's result disagree with the sender's checksum (corruption, or another base)."""


class DeltaBaseError(DeltaRefusedError):
    """A delta was offered onto another step than the rollout serves: only a seed can bring it back."""
