"""Errors of the checkpoint engines, part of the one tree rooted at :class:`hal.errors.HalError`.

Each also derives from the built-in a caller would naturally catch: ``ValueError`` for a step or a tensor
that disagrees with what was asked, ``RuntimeError`` for a transfer that failed, ``TypeError`` for an
engine that breaks the async contract.
"""

from __future__ import annotations

from hal.errors import HalError


class CheckpointEngineError(HalError):
    """Base class of every error raised on purpose by ``ckpt``."""


class VersionMismatchError(CheckpointEngineError, ValueError):
    """A receiver asked for step ``expected`` and the weights on offer carry step ``received``.

    Raised by ``receive_weights(global_steps=N)`` before any tensor is yielded; the collective engine first
    receives and discards the whole update so the group stays in step and the next update works.
    """

    def __init__(self, expected: int | None, received: int | None, where: str = "") -> None:
        self.expected, self.received = expected, received
        super().__init__(f"version mismatch{' in ' + where if where else ''}: asked for global_steps={expected}, "
                         f"but the weights on offer carry global_steps={received}")


class WeightMismatchError(CheckpointEngineError, ValueError):
    """A received tensor's name, dtype or shape disagrees with what the rollout expects; names the tensor."""


class TransferError(CheckpointEngineError, RuntimeError):
    """Weights could not be moved: a peer died or timed out, a file is missing, or the protocol broke."""


class TransferAbortedError(TransferError):
    """The sender failed on its side mid-update (its weights iterator raised) and told the receivers;
    nothing of that update is applied, and the transport stays usable for the next one."""


class TransferTimeoutError(TransferError, TimeoutError):
    """A peer did not answer within the configured timeout (it is dead, missing, or stuck)."""


class DuplicateCheckpointEngineError(CheckpointEngineError, ValueError):
    """A checkpoint engine was registered under a name that is already taken."""


class UnknownCheckpointEngineError(CheckpointEngineError, KeyError):
    """No checkpoint engine is registered under the asked name; the message lists the known ones and the
    backends that failed to import, with their errors."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class CheckpointEngineUnavailableError(CheckpointEngineError, RuntimeError):
    """A registered engine cannot run here (its library is missing, or no device kind it supports is
    available); the message says why and which engines are available."""


class ContractError(CheckpointEngineError, TypeError):
    """An engine breaks the ``CheckpointEngine`` contract (e.g. ``send_weights`` is a plain ``def``)."""


class CheckpointConfigError(CheckpointEngineError, ValueError):
    """A bad argument or configuration value (names the value and what is accepted)."""
