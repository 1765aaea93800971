"""A checkpoint engine of wire format ``delta_flush`` over any hal engine, for verl's rollout adapters
(``update_weights(engine.receive_weights(...), wire_format="delta_flush")``); the lifecycle is ``inner``'s.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

import torch

from ckpt.base import CheckpointEngine
from ckpt.checker import Digester
from ckpt.delta.sender import DEFAULT_FLUSH_BYTES, DeltaSender, Flush, UpdateStats
from ckpt.delta.transport import delta_send, receive_delta_flushes
from ckpt.errors import CheckpointConfigError


class DeltaCheckpointEngine(CheckpointEngine):
    """Delta weight sync over ``inner``, any engine of ``wire_format = "named_tensors"``.

    Each ``send_weights`` is a delta against ``sender``'s snapshot, or a full seed (first update, after
    :meth:`reseed`, after an update that raised, when ``inner.topology`` changed). ``receive_weights`` yields
    flushes owned by the consumer. ``sender`` defaults to one with ``flush_bytes`` half of ``inner.bucket_size``.
    Memory: :attr:`DeltaSender.snapshot_bytes` of host memory plus ``inner``'s own.
    """

    wire_format = "delta_flush"

    def __init__(self, inner: CheckpointEngine, sender: DeltaSender | None = None) -> None:
        if getattr(inner, "wire_format", "named_tensors") != "named_tensors" or not hasattr(inner, "send_weights"):
            raise CheckpointConfigError(f"DeltaCheckpointEngine carries flushes over a 'named_tensors' engine, got "
                                        f"{type(inner).__name__} (wire_format={getattr(inner, 'wire_format', None)!r})")
        self.inner = inner
        bucket = getattr(inner, "bucket_size", None)
        flush_bytes = max(1, bucket // 2) if isinstance(bucket, int) and bucket > 0 else DEFAULT_FLUSH_BYTES
        self.sender = sender or DeltaSender(flush_bytes=flush_bytes, device=getattr(inner, "device_kind", None))
        self._topology: Any = None
        self.last_stats: UpdateStats | None = None

    def reseed(self, reason: str = "asked") -> None:
        """Make the next update a full seed (a rollout joined late, failed, or restarted)."""
        self.sender.reseed(reason)

    @property
    def snapshot_bytes(self) -> int:
        """Return the host bytes of the sender's snapshot."""
        return self.sender.snapshot_bytes

    # ---- lifecycle: inner's -------------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        return self.inner.prepare()

    def init_process_group(self, **kwargs: Any) -> None:
        self.inner.init_process_group(**kwargs)

    def finalize(self) -> None:
        self.inner.finalize()

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()

    def promise_reports(self, arm: bool = True) -> bool:
        return self.inner.promise_reports(arm)

    def report_outcome(self, error: BaseException | None = None, live: Any = None) -> None:
        self.inner.report_outcome(error, live)

    @property
    def outcomes(self) -> dict:
        return self.inner.outcomes

    # ---- transfer -----------------------------------------------------------------------------------
    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]], global_steps: int | None = None, *,
                           check: bool = False) -> None:
        """Publish ``weights`` as a delta (or a seed) through ``inner``; ``check`` compares the rollouts' live
        parameters with ``weights`` (:mod:`ckpt.checker`). A refusal makes the next update a seed."""
        topology = getattr(self.inner, "topology", None)
        if topology is not None and self._topology is not None and topology != self._topology:
            self.sender.reseed(f"topology changed: {self._topology} -> {topology}")
        self._topology = topology
        digester = Digester() if check else None
        if digester is not None:
            weights = digester.watch(weights)
        self.last_stats = await delta_send(self.inner, weights, global_steps, self.sender, check=digester)

    async def receive_weights(self, global_steps: int | None = None, **kwargs: Any) -> AsyncIterator[Flush]:
        """Yield ``(named_tensors, is_last)`` flushes of one update (verl's ``delta_flush``)."""
        async for flush in receive_delta_flushes(self.inner, global_steps, **kwargs):
            self.received_global_steps = getattr(self.inner, "received_global_steps", global_steps)
            yield flush


def delta_engine_class(inner_cls: type[CheckpointEngine], name: str | None = None) -> type[DeltaCheckpointEngine]:
    """Return a :class:`DeltaCheckpointEngine` subclass building its own ``inner_cls(**kwargs)`` (verl's registry).

    Example: ``CheckpointEngineRegistry.register("hal-delta")(delta_engine_class(CollectiveCheckpointEngine))``.
    """

    class Engine(DeltaCheckpointEngine):
        __doc__ = f"Delta weight sync over {inner_cls.__name__} (see DeltaCheckpointEngine)."

        def __init__(self, *args: Any, sender: DeltaSender | None = None, **kwargs: Any) -> None:
            super().__init__(inner_cls(*args, **kwargs), sender=sender)

        @classmethod
        def build_topology(cls, trainer_world_size: int, rollout_world_size: int, metadata: list):
            return inner_cls.build_topology(trainer_world_size, rollout_world_size, metadata)

    Engine.__name__ = Engine.__qualname__ = name or f"Delta{inner_cls.__name__}"
    return Engine
