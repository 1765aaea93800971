"""Workers that carry ``global_steps`` end to end: trainer -> checkpoint engine -> rollout server adapter.

trainer ``TrainerWorker.update_weights(step)`` -> ``send_weights(engine.get_per_tensor_param(), step)`` ->
``receive_weights(step)`` -> ``adapter.update_weights(weights, step)`` in ``CheckpointEngineWorker``; the
names follow verl's ``update_weights(global_steps)`` path.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Mapping

import torch

from ckpt.base import CheckpointEngine, NamedTensor, check_global_steps
from ckpt.errors import CheckpointConfigError, WeightMismatchError


def _per_tensor_params(engine: Any):
    """``engine.get_per_tensor_param()`` as an iterable of ``(name, tensor)``.

    verl's engines return ``(per_tensor_param, peft_config)``; a plain iterable of pairs is accepted too.
    """
    getter = getattr(engine, "get_per_tensor_param", None)
    if getter is None:
        raise CheckpointConfigError(f"{type(engine).__name__} has no get_per_tensor_param(); the trainer "
                                    "engine must provide one returning (name, tensor) pairs")
    result = getter()
    if isinstance(result, tuple) and len(result) == 2 and not isinstance(result[0], str):
        return result[0]
    return result


class TrainerWorker:
    """Trainer side: publishes the training engine's weights tagged with ``global_steps``.

    Args:
        engine: any object with ``get_per_tensor_param()`` (the engines package, or a stand-in).
        checkpoint_engine: the sending :class:`CheckpointEngine`.
    """

    def __init__(self, engine: Any, checkpoint_engine: CheckpointEngine) -> None:
        self.engine, self.checkpoint_engine = engine, checkpoint_engine

    async def update_weights(self, global_steps: int) -> None:
        """Send ``engine.get_per_tensor_param()`` as step ``global_steps``; returns when delivered
        (the engine may then change its parameters)."""
        await self.checkpoint_engine.send_weights(_per_tensor_params(self.engine), check_global_steps(global_steps))


class _StepTagged:
    """The engine's receive stream with ``global_steps`` (the sender's step) readable once it started."""

    def __init__(self, engine: CheckpointEngine, stream: AsyncIterator[NamedTensor]) -> None:
        self._engine, self._stream = engine, stream

    @property
    def global_steps(self) -> int | None:
        return self._engine.received_global_steps

    def __aiter__(self):
        return self

    async def __anext__(self) -> NamedTensor:
        return await self._stream.__anext__()

    async def aclose(self) -> None:
        await self._stream.aclose()


class CheckpointEngineWorker:
    """Rollout side: receives one update and hands it to the server adapter.

    Args:
        checkpoint_engine: the receiving :class:`CheckpointEngine`.
        adapter: any object with ``async update_weights(weights, global_steps)`` (e.g.
            :class:`InMemoryRolloutAdapter`, or a vLLM / SGLang server adapter).
    """

    def __init__(self, checkpoint_engine: CheckpointEngine, adapter: Any) -> None:
        self.checkpoint_engine, self.adapter = checkpoint_engine, adapter

    async def update_weights(self, global_steps: int | None) -> int | None:
        """Receive step ``global_steps`` (``None``: whatever is sent) and apply it; returns the step applied.

        Raises:
            VersionMismatchError: the sender sent another step (nothing is applied).
            WeightMismatchError, TransferError: from the adapter / engine; the adapter keeps its previous
                weights and step.
        """
        global_steps = check_global_steps(global_steps)
        stream = _StepTagged(self.checkpoint_engine, self.checkpoint_engine.receive_weights(global_steps))
        await self.adapter.update_weights(stream, global_steps)
        return self.checkpoint_engine.received_global_steps


ExpectedSpec = Mapping[str, Any]


class InMemoryRolloutAdapter:
    """A reference rollout server: holds a state dict and applies updates all-or-nothing.

    Args:
        expected: what the rollout expects, ``{name: (shape, dtype)}``, or a state dict
            ``{name: tensor}`` (its tensors become the initial weights, step ``None``), or ``None`` (accept
            anything). With an expectation, an unknown name or a dtype/shape disagreement raises
            :class:`WeightMismatchError` naming the tensor.

    An update stages a private copy of every received tensor (so views into a transport buffer may be
    reused afterwards) and swaps weights and step in only once the stream ended without error; on any
    failure the previous weights and step stay in service, and the rest of the stream is drained so the
    transport stays in step. Names an update does not carry keep their previous tensors.
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
        if self._expected is None:
            return
        if name not in self._expected:
            raise WeightMismatchError(f"received tensor {name!r} is not among the {len(self._expected)} "
                                      f"tensors the rollout expects")
        shape, dtype = self._expected[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise WeightMismatchError(f"tensor {name!r}: received {tensor.dtype} {tuple(tensor.shape)}, "
                                      f"the rollout expects {dtype} {shape}")

    async def update_weights(self, weights: AsyncIterator[NamedTensor], global_steps: int | None) -> None:
        """Apply one update all-or-nothing and serve step ``global_steps`` (``None``: the stream's
        ``global_steps`` attribute if it has one).

        Raises:
            WeightMismatchError: a name, dtype or shape disagrees with ``expected`` (names the tensor).
            Anything the stream raises (VersionMismatchError, TransferError). In every case the previous
            weights and step stay in service.
        """
        staged: dict[str, torch.Tensor] = {}
        error: BaseException | None = None
        async for name, tensor in weights:
            if error is not None:
                continue  # drain: keep the transport in step, apply nothing
            try:
                self._check(name, tensor)
                staged[name] = tensor.detach().clone()
            except WeightMismatchError as exc:
                error = exc
        if error is not None:
            raise error
        if global_steps is None:
            global_steps = getattr(weights, "global_steps", None)
        self._weights.update(staged)
        self.served_step = global_steps

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights in service, ``{name: tensor}`` (a new dict; the tensors are the served ones)."""
        return dict(self._weights)
