"""Workers that carry ``global_steps`` end to end: trainer -> checkpoint engine -> rollout server adapter.

Names and keywords follow verl 0.9.1's ``update_weights`` path, so verl's server adapters and hal's are
interchangeable."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Mapping

import torch

from ckpt.base import CheckpointEngine, NamedTensor, check_global_steps, drain
from ckpt.errors import CheckpointConfigError
from ckpt.outcome import carries_reports


def _per_tensor_params(engine: Any, base_sync_done: bool | None = None) -> tuple[Any, dict[str, Any] | None]:
    """Return ``(the (name, tensor) iterable, peft_config)`` of ``engine.get_per_tensor_param()``.

    ``base_sync_done`` is passed on when given; a LoRA ``peft_config`` is refused without it (the rollouts could
    not tell the adapter from the base)."""
    getter = getattr(engine, "get_per_tensor_param", None)
    if getter is None:
        raise CheckpointConfigError(f"{type(engine).__name__} has no get_per_tensor_param(); the trainer "
                                    "engine must provide one returning (generator, peft_config)")
    result = getter() if base_sync_done is None else getter(base_sync_done=base_sync_done)
    if isinstance(result, tuple) and len(result) == 2 and not _is_pair(result[1]):
        per_tensor_param, peft_config = result
        if peft_config is not None and base_sync_done is None:
            raise CheckpointConfigError(f"{type(engine).__name__}.get_per_tensor_param() returned a peft_config "
                                        f"({type(peft_config).__name__}); pass base_sync_done (LoRA adapters) or "
                                        "publish merged weights")
        return per_tensor_param, peft_config
    return result, None


def _is_pair(item: Any) -> bool:
    return isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)


class TrainerWorker:
    """Trainer side: publishes the training engine's ``get_per_tensor_param()`` tagged with ``global_steps``."""

    def __init__(self, engine: Any, checkpoint_engine: CheckpointEngine) -> None:
        self.engine, self.checkpoint_engine = engine, checkpoint_engine
        self.peft_config: dict[str, Any] | None = None  # of the last update (what its rollouts are told)

    async def update_weights(self, global_steps: int | None = None, base_sync_done: bool | None = None,
                             **_verl_kwargs: Any) -> None:
        """Send the engine's weights as step ``global_steps``; return when delivered (verl's ``mode`` is accepted).

        ``base_sync_done`` (LoRA): ``True`` sends the adapter alone, ``False`` the base."""
        weights, self.peft_config = _per_tensor_params(self.engine, base_sync_done)
        await self.checkpoint_engine.send_weights(weights, check_global_steps(global_steps))


class _StepTagged:

    def __init__(self, engine: CheckpointEngine, stream: AsyncIterator[NamedTensor]) -> None:
        self._engine, self._stream = engine, stream
        self.finished = False

    @property
    def global_steps(self) -> int | None:
        return self._engine.received_global_steps

    def __aiter__(self):
        return self

    async def __anext__(self) -> NamedTensor:
        try:
            return await self._stream.__anext__()
        except BaseException:
            self.finished = True  # ended (StopAsyncIteration) or raised: nothing more to drain
            raise

    async def aclose(self) -> None:
        await self._stream.aclose()


class CheckpointEngineWorker:
    """Rollout side: receives one update and hands it to the server adapter (verl's ``update_weights`` keywords).

    An adapter's ``receive_placement``, if it has one, is passed to ``receive_weights(..., placement=...)``; a LoRA
    update's ``peft_config`` and ``base_sync_done`` to the adapter's ``update_weights``. After every update the
    engine tells the sender whether it was applied and why not (:mod:`ckpt.outcome`), with the adapter's
    ``state_dict()`` for a weight check."""

    def __init__(self, checkpoint_engine: CheckpointEngine, adapter: Any) -> None:
        self.checkpoint_engine, self.adapter = checkpoint_engine, adapter
        self.reports = carries_reports(checkpoint_engine)  # the engine carries our word back

    async def update_weights(self, global_steps: int | None = None, peft_config: dict[str, Any] | None = None,
                             base_sync_done: bool = False) -> int | None:
        """Receive step ``global_steps`` and apply it; return the step applied.

        If the adapter raises, the rest of the update is drained and ``received_global_steps`` is restored before
        the error propagates: an update not applied does not count as received."""
        global_steps = check_global_steps(global_steps)
        engine = self.checkpoint_engine
        if self.reports:
            engine.promise_reports()  # this update is reported (one received otherwise is answered "received")
        placement = getattr(self.adapter, "receive_placement", None)
        received_before = getattr(engine, "received_global_steps", None)
        if placement is None:
            call = engine.receive_weights(global_steps)
        else:  # the transport may write straight into the served model's memory
            call = engine.receive_weights(global_steps, placement=placement)
        stream = _StepTagged(engine, call)
        try:
            lora = {} if peft_config is None else {"peft_config": peft_config, "base_sync_done": base_sync_done}
            await self.adapter.update_weights(stream, global_steps=global_steps,
                                              wire_format=getattr(engine, "wire_format", "named_tensors"), **lora)
        except Exception as exc:
            if not stream.finished:
                await drain(stream)
            engine.received_global_steps = received_before  # not applied: not received
            await self._report(exc)
            raise
        served = engine.received_global_steps  # before the report: a colocated engine is shared by its rollouts
        await self._report(None)
        return served

    async def _report(self, error: BaseException | None) -> None:
        if not self.reports:
            return
        try:  # in a thread: a checked update waits for the sender's digests, which may run on this event loop
            await asyncio.to_thread(self.checkpoint_engine.report_outcome, error,
                                    getattr(self.adapter, "state_dict", None))
        except Exception:  # noqa: BLE001 - the sender's wait for it times out and names this rollout
            pass


ExpectedSpec = Mapping[str, Any]
