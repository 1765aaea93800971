"""Workers that carry ``global_steps`` end to end: trainer -> checkpoint engine -> rollout server adapter.

trainer ``TrainerWorker.update_weights(global_steps)`` -> ``send_weights(per_tensor_param, global_steps)``
(``per_tensor_param, peft_config = engine.get_per_tensor_param()``) -> ``receive_weights(global_steps)`` ->
``adapter.update_weights(weights, global_steps=..., wire_format=...)`` in ``CheckpointEngineWorker``; the
names and keywords follow verl 0.9.1's ``update_weights`` path (``verl/checkpoint_engine/base.py``,
``verl/workers/rollout/base.py``), so verl's server adapters and hal's are interchangeable.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Iterable, Mapping

import torch

from ckpt.base import CheckpointEngine, NamedTensor, check_global_steps
from ckpt.errors import CheckpointConfigError, WeightMismatchError


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


async def _as_async(weights: Iterable[NamedTensor] | AsyncIterator[NamedTensor]) -> AsyncIterator[NamedTensor]:
    """An async iterator over ``weights`` (async or plain iterable: verl's colocated path passes a generator)."""
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


async def drain(weights: Any) -> None:
    """Consume what is left of a receive stream (async or plain), discarding it, so its transport stays in
    step; a stream that raises is left as it is (it already ended)."""
    try:
        async for _ in _as_async(weights):
            pass
    except Exception:  # noqa: BLE001 - the update failed anyway; the caller raises the first error
        pass


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


def _unexpected_names(missing: list[str], extra: list[str], expected: int, shown: int = 8) -> str:
    """What an update got wrong about the names of ``expected`` tensors (at most ``shown`` of each)."""
    def names(found: list[str]) -> str:
        more = f" and {len(found) - shown} more" if len(found) > shown else ""
        return ", ".join(repr(n) for n in found[:shown]) + more
    parts = []
    if missing:
        parts.append(f"lacks {len(missing)} of the {expected} tensors the rollout expects ({names(missing)})")
    if extra:
        parts.append(f"carries {len(extra)} tensor(s) the rollout does not expect ({names(extra)})")
    return "the update " + " and ".join(parts) + "; nothing applied"


class InMemoryRolloutAdapter:
    """A reference rollout server: holds a state dict and applies updates all-or-nothing.

    Args:
        expected: what the rollout expects, ``{name: (shape, dtype)}``, or a state dict
            ``{name: tensor}`` (its tensors become the initial weights, step ``None``), or ``None`` (accept
            anything). With an expectation, every update must carry exactly the expected names, each with
            its dtype and shape: a disagreement raises :class:`WeightMismatchError` naming the tensor, and
            an update that lacks expected names or brings others raises it naming them (all of both).

    An update stages a private copy of every received tensor (so views into a transport buffer may be
    reused afterwards) and swaps weights and step in only once the stream ended without error and, with
    an expectation, every expected tensor arrived; on any failure the previous weights and step stay in
    service, and the rest of the stream is drained so the transport stays in step. Without an expectation,
    names an update does not carry keep their previous tensors.
    Memory: one extra copy of the update while staging.
    """

    def __init__(self, expected: Mapping[str, Any] | None = None) -> None:
        self._weights: dict[str, torch.Tensor] = {}
        self._expected: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
        self.served_step: int | None = None
        """The ``global_steps`` of the weights in service (``None`` before the first update)."""
        if expected is not None:
            self._expected = {}
            for name, spec in expected.items():
                if isinstance(spec, torch.Tensor):
                    self._expected[name] = (tuple(spec.shape), spec.dtype)
                    self._weights[name] = spec.detach().clone()
                elif isinstance(spec, (tuple, list)) and len(spec) == 2 and isinstance(spec[1], torch.dtype):
                    self._expected[name] = (tuple(spec[0]), spec[1])
                else:
                    raise CheckpointConfigError(f"expected[{name!r}] must be a tensor or (shape, dtype), got {spec!r}")

    def _check(self, name: str, tensor: torch.Tensor) -> None:
        if self._expected is None or name not in self._expected:
            return  # an unexpected name is reported with the missing ones once the stream ended
        shape, dtype = self._expected[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise WeightMismatchError(f"tensor {name!r}: received {tensor.dtype} {tuple(tensor.shape)}, "
                                      f"the rollout expects {dtype} {shape}")

    async def update_weights(self, weights: Iterable[NamedTensor] | AsyncIterator[NamedTensor],
                             wire_format: str = "named_tensors", *, global_steps: int | None = None,
                             peft_config: Any = None, **kwargs: Any) -> None:
        """Apply one update all-or-nothing and serve step ``global_steps`` (``None``: the stream's
        ``global_steps`` attribute if it has one). The signature is verl's ``BaseRollout.update_weights``.

        Args:
            weights: async or plain iterable of ``(name, tensor)``.
            wire_format: ``"named_tensors"`` (verl's other format, ``"delta_flush"``, is refused).
            global_steps: the step these weights are (keyword, as verl passes it).
            peft_config: must be ``None`` (a LoRA adapter cannot be applied to plain weights).
            kwargs: verl's further keywords (``base_sync_done``, ...), accepted and ignored.

        Raises:
            WeightMismatchError: a dtype or shape disagrees with ``expected`` (names the tensor), or the
                update lacks expected tensors or carries unexpected ones (names them).
            CheckpointConfigError: another ``wire_format``, a ``peft_config`` or a bad ``global_steps``.
            Anything the stream raises (VersionMismatchError, TransferError). In every case the previous
            weights and step stay in service, and the rest of the stream is drained.
        """
        try:
            if wire_format != "named_tensors":
                raise CheckpointConfigError(f"wire_format must be 'named_tensors', got {wire_format!r}")
            if peft_config is not None:
                raise CheckpointConfigError(f"peft_config must be None (this rollout holds plain weights), "
                                            f"got {type(peft_config).__name__}")
            global_steps = check_global_steps(global_steps)
            staged: dict[str, torch.Tensor] = {}
            extra: list[str] = []
            async for name, tensor in _as_async(weights):
                self._check(name, tensor)
                if self._expected is not None and name not in self._expected:
                    extra.append(name)
                else:
                    staged[name] = tensor.detach().clone()
            if self._expected is not None:
                missing = [n for n in self._expected if n not in staged]
                if missing or extra:
                    raise WeightMismatchError(_unexpected_names(missing, extra, len(self._expected)))
        except Exception:
            await drain(weights)  # keep the transport in step, apply nothing
            raise
        if global_steps is None:
            global_steps = getattr(weights, "global_steps", None)
        self._weights.update(staged)
        self.served_step = global_steps

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights in service, ``{name: tensor}`` (a new dict; the tensors are the served ones)."""
        return dict(self._weights)
