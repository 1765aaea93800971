"""Workers that carry ``global_steps`` end to end: trainer -> checkpoint engine -> rollout server adapter.

trainer ``TrainerWorker.update_weights(global_steps)`` -> ``send_weights(per_tensor_param, global_steps)``
(``per_tensor_param, peft_config = engine.get_per_tensor_param()``) -> ``receive_weights(global_steps)`` ->
``adapter.update_weights(weights, global_steps=..., wire_format=...)`` in ``CheckpointEngineWorker``; the
names and keywords follow verl 0.9.1's ``update_weights`` path (``verl/checkpoint_engine/base.py``,
``verl/workers/rollout/base.py``), so verl's server adapters and hal's are interchangeable.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Mapping

import torch

from ckpt.base import CheckpointEngine, NamedTensor, check_global_steps, drain
from ckpt.errors import CheckpointConfigError


def _per_tensor_params(engine: Any):
    """The ``(name, tensor)`` iterable of ``engine.get_per_tensor_param()``.

    verl's engines (and hal's) return ``(per_tensor_param, peft_config)``; a plain iterable of pairs (a
    stand-in) is accepted too. A LoRA ``peft_config`` cannot be published as plain weights and is refused.

    Raises:
        CheckpointConfigError: no ``get_per_tensor_param``, or a ``peft_config`` that is not ``None``.
    """
    getter = getattr(engine, "get_per_tensor_param", None)
    if getter is None:
        raise CheckpointConfigError(f"{type(engine).__name__} has no get_per_tensor_param(); the trainer "
                                    "engine must provide one returning (generator, peft_config)")
    result = getter()
    if isinstance(result, tuple) and len(result) == 2 and not _is_pair(result[1]):
        per_tensor_param, peft_config = result
        if peft_config is not None:
            raise CheckpointConfigError(f"{type(engine).__name__}.get_per_tensor_param() returned a peft_config "
                                        f"({type(peft_config).__name__}); publish merged weights instead")
        return per_tensor_param
    return result


def _is_pair(item: Any) -> bool:
    return isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)


class TrainerWorker:
    """Trainer side: publishes the training engine's weights tagged with ``global_steps``.

    Args:
        engine: any object with ``get_per_tensor_param()`` (the engines package, or a stand-in).
        checkpoint_engine: the sending :class:`CheckpointEngine`.
    """

    def __init__(self, engine: Any, checkpoint_engine: CheckpointEngine) -> None:
        self.engine, self.checkpoint_engine = engine, checkpoint_engine

    async def update_weights(self, global_steps: int | None = None, **_verl_kwargs: Any) -> None:
        """Send ``engine.get_per_tensor_param()`` as step ``global_steps``; returns when delivered
        (the engine may then change its parameters). Further keywords (verl's ``mode``) are accepted."""
        await self.checkpoint_engine.send_weights(_per_tensor_params(self.engine), check_global_steps(global_steps))


class _StepTagged:
    """The engine's receive stream with ``global_steps`` (the sender's step) readable once it started."""

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
    """Rollout side: receives one update and hands it to the server adapter.

    Args:
        checkpoint_engine: the receiving :class:`CheckpointEngine`.
        adapter: any object with ``async update_weights(weights, global_steps=..., wire_format=...)``, the
            keywords verl's ``CheckpointEngineWorker`` passes (e.g. :class:`InMemoryRolloutAdapter`, or a
            verl vLLM / SGLang server adapter).
            An adapter with a ``receive_placement`` (an object with ``target(name, dtype, shape) ->
            Tensor | None``, the ``ReceivePlacement`` protocol; e.g.
            :class:`ckpt.serving.ModelRolloutAdapter`) has it passed to the engine as
            ``receive_weights(global_steps, placement=...)``, so the engine may receive straight into the
            adapter's memory; an engine that cannot use it ignores it. An adapter without one gets the plain
            ``receive_weights(global_steps)`` call (verl's engines take no ``placement``).
    """

    def __init__(self, checkpoint_engine: CheckpointEngine, adapter: Any) -> None:
        self.checkpoint_engine, self.adapter = checkpoint_engine, adapter

    async def update_weights(self, global_steps: int | None = None) -> int | None:
        """Receive step ``global_steps`` (``None``: whatever is sent) and apply it; returns the step applied.

        Whatever the adapter raises, the rest of the update is received and discarded before the error
        propagates, so every engine is ready for the next update (a colocated engine keeps no stale
        hand-over, a collective group stays in step), and the engine's ``received_global_steps`` goes back
        to what it was: an update that was not applied does not count as received (a file engine asked for
        "the newest step newer than the last received" offers the failed step again).

        Raises:
            VersionMismatchError: the sender sent another step (nothing is applied).
            WeightMismatchError, TransferError: from the adapter / engine; the adapter keeps its previous
                weights and step. Anything else the adapter raises (e.g. ``TypeError`` for a keyword it
                does not take).
        """
        global_steps = check_global_steps(global_steps)
        engine = self.checkpoint_engine
        placement = getattr(self.adapter, "receive_placement", None)
        received_before = getattr(engine, "received_global_steps", None)
        if placement is None:
            call = engine.receive_weights(global_steps)
        else:  # the transport may write straight into the served model's memory
            call = engine.receive_weights(global_steps, placement=placement)
        stream = _StepTagged(engine, call)
        try:
            await self.adapter.update_weights(stream, global_steps=global_steps,
                                              wire_format=getattr(engine, "wire_format", "named_tensors"))
        except Exception:
            if not stream.finished:
                await drain(stream)
            engine.received_global_steps = received_before  # not applied: not received
            raise
        return self.checkpoint_engine.received_global_steps


ExpectedSpec = Mapping[str, Any]
