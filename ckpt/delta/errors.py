"""Errors of delta weight sync (one tree with ``ckpt``'s: a refused update is a :class:`WeightMismatchError`)."""

from __future__ import annotations

from ckpt.errors import WeightMismatchError


class DeltaRefusedError(WeightMismatchError):
    """A rollout refused a ``delta_flush`` update: nothing of it is served (atomic), or the rollout is now
    degraded (in place). Either way it needs a full seed next (``DeltaSender.reseed()``).

    Attributes:
        tensor: the tensor named in the refusal, or ``None`` when the flush as a whole was bad.
        step: the step the update would have produced.
    """

    def __init__(self, message: str, tensor: str | None = None, step: int | None = None) -> None:
        self.tensor, self.step = tensor, step
        super().__init__(message)


class DeltaChecksumError(DeltaRefusedError):
    """A flush's bytes or a tensor's result disagree with the checksum the sender computed (corruption in
    transit or a receiver that does not hold what the sender diffed against)."""


class DeltaBaseError(DeltaRefusedError):
    """A delta was offered onto another step than the rollout serves (it missed an update, or its last one
    failed): only a seed can bring it back."""
