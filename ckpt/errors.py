"""Errors of the checkpoint engines, under :class:`hal.errors.HalError` and the built-in a caller would catch."""

from __future__ import annotations

from hal.errors import HalError


class CheckpointEngineError(HalError):
    """Base class of every error raised on purpose by ``ckpt``."""


class VersionMismatchError(CheckpointEngineError, ValueError):
    """A receiver asked for step ``expected`` and the weights on offer carry step ``received``."""

    def __init__(self, expected: int | None, received: int | None, where: str = "") -> None:
        self.expected, self.received = expected, received
        super().__init__(f"version mismatch{' in ' + where if where else ''}: asked for global_steps={expected}, "
                         f"but the weights on offer carry global_steps={received}")


class WeightMismatchError(CheckpointEngineError, ValueError):
    """A received tensor's name, dtype or shape disagrees with what the rollout expects; names the tensor."""


class UpdateRefusedError(CheckpointEngineError, RuntimeError):
    """Rollouts received an update and did not apply it (:mod:`ckpt.outcome`); ``refusals`` maps each to its cause."""

    def __init__(self, text: str, refusals: dict | None = None, outcomes: dict | None = None) -> None:
        super().__init__(text)
        self.refusals, self.outcomes = refusals or {}, outcomes or {}


class WeightCheckError(CheckpointEngineError, RuntimeError):
    """A rollout serves other values than the trainer published (:mod:`ckpt.checker`); ``mismatches`` maps each
    rollout to its sentences."""

    def __init__(self, text: str, mismatches: dict | None = None, outcomes: dict | None = None) -> None:
        super().__init__(text)
        self.mismatches, self.outcomes = mismatches or {}, outcomes or {}


class TransferError(CheckpointEngineError, RuntimeError):
    """Weights could not be moved: a peer died or timed out, a file is missing, or the protocol broke."""


class SendInProgressError(CheckpointEngineError, RuntimeError):
    """``send_weights`` was called while the same engine's previous call still runs; names that call's step."""


class TransferAbortedError(TransferError):
    """The sender failed mid-update and told the receivers; nothing of it is applied, the transport stays usable."""


class TransferTimeoutError(TransferError, TimeoutError):
    """A peer did not answer within the configured timeout (it is dead, missing, or stuck)."""


class DuplicateCheckpointEngineError(CheckpointEngineError, ValueError):
    """A checkpoint engine was registered under a name that is already taken."""


class UnknownCheckpointEngineError(CheckpointEngineError, KeyError):
    """No engine is registered under the name; the message lists the known ones and the failed imports."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class CheckpointEngineUnavailableError(CheckpointEngineError, RuntimeError):
    """A registered engine cannot run here; the message says why and which engines are available."""


class ContractError(CheckpointEngineError, TypeError):
    """An engine breaks the ``CheckpointEngine`` contract (e.g. ``send_weights`` is a plain ``def``)."""


class CheckpointConfigError(CheckpointEngineError, ValueError):
    """A bad argument or configuration value (names the value and what is accepted)."""
