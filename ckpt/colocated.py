"""Hand-over of weights inside one process (trainer and rollout colocated), zero copy."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Iterable

from ckpt.base import CheckpointEngine, NamedTensor, check_global_steps, check_step
from ckpt.errors import CheckpointConfigError, TransferError, TransferTimeoutError


class ColocatedCheckpointEngine(CheckpointEngine):
    """One instance shared by the trainer and the rollout of a process; nothing is copied.

    ``send_weights`` stores the caller's iterable (not even iterated) with its ``global_steps``;
    ``receive_weights`` iterates it lazily and yields the caller's own tensors, in the order the iterable
    produces them. Ownership: the receiver gets the trainer's live tensors (no copy, same storage), so it
    must copy them (``param.copy_(t)``) before the trainer's next optimizer step if it needs a snapshot.

    Args:
        bucket_size, is_master: accepted as verl's registry passes them (nothing is bucketed here).
        timeout: seconds ``receive_weights`` waits for a ``send_weights`` before raising
            :class:`TransferTimeoutError`.

    The lifecycle (``prepare``, ``build_topology``, ``init_process_group``, ``finalize``) is the ABC's no-op.

    Raises (``send_weights``): TransferError if the previous hand-over was never received.
    """

    def __init__(self, bucket_size: int | None = None, is_master: bool = False, timeout: float = 60.0) -> None:
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise CheckpointConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.timeout = float(timeout)
        self.bucket_size, self.is_master = bucket_size, bool(is_master)
        self._handoff: tuple[int | None, Iterable[NamedTensor]] | None = None
        self._ready: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _event(self) -> asyncio.Event:
        """The "offered" event of the running loop (a new loop, e.g. a second ``asyncio.run``, gets a new one)."""
        loop = asyncio.get_running_loop()
        if self._ready is None or self._loop is not loop:
            self._ready, self._loop = asyncio.Event(), loop
            if self._handoff is not None:
                self._ready.set()
        return self._ready

    async def send_weights(self, weights: Iterable[NamedTensor], global_steps: int | None = None) -> None:
        """Offer ``weights`` (``(name, tensor)`` iterable) tagged ``global_steps``; returns at once."""
        global_steps = check_global_steps(global_steps)
        if self._handoff is not None:
            raise TransferError(f"the hand-over of global_steps={self._handoff[0]} was never received; "
                                f"cannot offer global_steps={global_steps}")
        self._handoff = (global_steps, weights)
        self._event().set()

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[NamedTensor]:
        """Yield the offered pairs (the sender's own tensors), waiting up to ``timeout`` s for an offer.

        Raises:
            VersionMismatchError: ``global_steps`` is given and the offer carries another step (the offer
                is dropped).
            TransferTimeoutError: nothing was offered within ``timeout``.
        """
        global_steps = check_global_steps(global_steps)
        try:
            await asyncio.wait_for(self._event().wait(), self.timeout)
        except asyncio.TimeoutError:
            raise TransferTimeoutError(f"no weights were offered to the colocated engine within {self.timeout:g} s") from None
        (step, weights), self._handoff = self._handoff, None
        self._event().clear()
        check_step(global_steps, step, "colocated hand-over")
        self.received_global_steps = step
        for name, tensor in weights:
            yield name, tensor
