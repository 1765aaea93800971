"""The ``CheckpointEngine`` contract: weight publication tagged with ``global_steps``, async everywhere.

The shape follows verl's checkpoint engines (``verl/checkpoint_engine``): a trainer side calls
``send_weights`` with an iterator of ``(name, tensor)``, a rollout side iterates ``receive_weights``; the
lifecycle hooks ``prepare`` / ``build_topology`` / ``init_process_group`` / ``finalize`` carry verl's names.
Every one of these is ``async`` in every implementation (upstream shipped an engine whose ``send_weights``
was a plain ``def``, so awaiting it raised ``TypeError``); :func:`check_async_contract` catches that class
of bug for any engine, and the registry refuses such a class.
"""

from __future__ import annotations

import abc
import inspect
from typing import Any, AsyncIterator, Iterable, Tuple

import torch

from ckpt.errors import CheckpointConfigError, ContractError, VersionMismatchError

NamedTensor = Tuple[str, torch.Tensor]

COROUTINE_METHODS = ("prepare", "build_topology", "init_process_group", "send_weights", "finalize")
"""Contract methods that must be ``async def`` (coroutine functions)."""
ASYNC_ITER_METHODS = ("receive_weights",)
"""Contract methods that must be async generator functions (``async def`` with ``yield``)."""


class CheckpointEngine(abc.ABC):
    """Moves named tensors from a trainer to rollout workers, tagged with the trainer's ``global_steps``.

    Contract (checked by :mod:`ckpt.testing` for any engine):

    * ``await send_weights(weights, global_steps)``: ``weights`` is an iterable of ``(name, tensor)``
      consumed once, in order; returns when the sender may reuse or free those tensors.
    * ``receive_weights(global_steps)`` is an async generator of ``(name, tensor)`` in the order they were
      sent. With ``global_steps=N`` it raises :class:`VersionMismatchError` (before yielding anything) if the
      update on offer carries another step. Once the first item is yielded (or the iterator ends),
      :attr:`received_global_steps` is the sender's step.
    * dtype, shape and bytes arrive unchanged (fp32, bf16, fp16, int64, bool, empty, 0-d and non-contiguous
      tensors; the received ones are contiguous).
    * Lifecycle: ``prepare()`` (buffers, metadata), ``build_topology()`` (who sends, who receives),
      ``init_process_group()``, ``finalize()``. Each defaults to a no-op; an engine that needs them runs
      the missing ones lazily on the first send or receive.

    Who owns which buffer after a call is engine specific and stated in each engine's docstring.
    """

    received_global_steps: int | None = None
    """The ``global_steps`` of the update most recently received by this instance (``None`` before any)."""

    async def prepare(self) -> None:
        """Allocate buffers and metadata (no-op by default)."""

    async def build_topology(self) -> Any:
        """Decide who sends and who receives (no-op by default)."""

    async def init_process_group(self) -> None:
        """Join the communicator used for transfers (no-op by default)."""

    @abc.abstractmethod
    async def send_weights(self, weights: Iterable[NamedTensor], global_steps: int | None = None) -> None:
        """Publish ``weights`` (iterable of ``(name, tensor)``) tagged with ``global_steps``."""

    @abc.abstractmethod
    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[NamedTensor]:
        """Yield the ``(name, tensor)`` pairs of one update; see the class docstring."""
        yield  # pragma: no cover - marks the abstract method as an async generator

    async def finalize(self) -> None:
        """Release the communicator and buffers (no-op by default)."""


def contract_violations(engine_or_cls: Any) -> list[str]:
    """Which contract methods of an engine (class or instance, subclass of the ABC or duck-typed) are not async.

    Returns:
        One line per violation, e.g. ``"send_weights is a plain function; it must be 'async def'"``;
        empty when the engine keeps the contract.
    """
    problems = []
    for name in COROUTINE_METHODS + ASYNC_ITER_METHODS:
        fn = getattr(engine_or_cls, name, None)
        if fn is None:
            problems.append(f"{name} is missing")
            continue
        if name in ASYNC_ITER_METHODS:
            if not inspect.isasyncgenfunction(fn):
                problems.append(f"{name} is {_kind(fn)}; it must be an async generator ('async def' with 'yield')")
        elif not inspect.iscoroutinefunction(fn):
            problems.append(f"{name} is {_kind(fn)}; it must be 'async def'")
    return problems


def _kind(fn: Any) -> str:
    if inspect.isasyncgenfunction(fn):
        return "an async generator function"
    if inspect.isgeneratorfunction(fn):
        return "a plain generator function"
    if callable(fn):
        return "a plain function"
    return f"not callable ({type(fn).__name__})"


def check_async_contract(engine_or_cls: Any) -> None:
    """Raise :class:`ContractError` listing every contract method of the engine that is not async."""
    problems = contract_violations(engine_or_cls)
    if problems:
        name = getattr(engine_or_cls, "__name__", type(engine_or_cls).__name__)
        raise ContractError(f"checkpoint engine {name} breaks the async contract: " + "; ".join(problems))


def check_step(asked: int | None, offered: int | None, where: str) -> None:
    """Raise :class:`VersionMismatchError` unless ``asked`` is ``None`` or equals ``offered``."""
    if asked is not None and asked != offered:
        raise VersionMismatchError(asked, offered, where)


def check_global_steps(global_steps: Any) -> int | None:
    """Validate a ``global_steps`` argument: ``None`` or a non-negative ``int`` (not ``bool``).

    Raises:
        CheckpointConfigError: anything else (a ``ValueError``; the message names the value).
    """
    if global_steps is None:
        return None
    if isinstance(global_steps, bool) or not isinstance(global_steps, int) or global_steps < 0:
        raise CheckpointConfigError(f"global_steps must be None or an int >= 0, got {global_steps!r}")
    return global_steps
