"""Delta weight sync in the job (``hal sync --wire-format delta``): the rollout's side, its memory, and the
fault policy that decides when the trainer re-seeds.

The trainer publishes with a :class:`ckpt.delta.DeltaSender` kept across steps. Each rollout applies updates
with a :class:`ckpt.delta.DeltaReceiver` straight onto its served tensors (:class:`DeltaServing`): a delta
holds only changed values, so it cannot go into a second bank; the receiver's atomic mode stages it instead.
A refused atomic update leaves the previous step served; a refused in-place one leaves none. The trainer
re-seeds after a rollout needs a seed, a failed step or a replaced rollout (:func:`reseed_reason`, the loop);
step 0 is a seed.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Sequence

import torch

WIRE_FORMATS = ("full", "delta")  # delta: verl's delta_flush

# an atomic receiver stages at most this many times the model's bytes (values + int64 positions of a
# tensor that stays sparse); a seed stages 1 x model
STAGED_FACTOR = 2


def flush_bytes(bucket_bytes: int) -> int:
    """The sender's flush size for ``bucket_bytes`` buckets: half a bucket, so positions and values fit one."""
    return max(1, bucket_bytes // 2)


def single_bank(module: torch.nn.Module, atomic: bool = True) -> Any:
    """The served model in a one-bank :class:`ckpt.ModelRolloutAdapter` (``atomic`` is the receiver's)."""
    import ckpt

    return ckpt.ModelRolloutAdapter(module, atomic=False)


class DeltaServing:
    """A rollout's served model taking ``delta_flush`` updates from ``engine``; has what the job reads of an
    adapter (``served_step``, ``state_dict()``, ``memory()``, ``staging``, ...)."""

    def __init__(self, adapter: Any, engine: Any, atomic: bool) -> None:
        from ckpt.delta import DeltaReceiver
        from ckpt.outcome import carries_reports

        self.adapter, self.engine, self.atomic = adapter, engine, bool(atomic)
        self.receiver = DeltaReceiver(adapter.state_dict(), atomic=self.atomic)
        self.reports = carries_reports(engine)  # the trainer hears of each update
        self.layout, self.device = adapter.layout, adapter.device
        self.error: str | None = None

    @property
    def served_step(self) -> int | None:
        """The step the served tensors hold (``None``: none yet, or an in-place update refused part way)."""
        return None if self.receiver.degraded else self.receiver.served_step

    @property
    def degraded(self) -> bool:
        """An in-place update was refused part way: the served tensors hold no consistent step."""
        return self.receiver.degraded

    @property
    def needs_seed(self) -> bool:
        """Only a full seed is taken next (initially, after a refused or failed update)."""
        return self.receiver.needs_seed

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The served tensors, ``{name: tensor}``."""
        return self.adapter.state_dict()

    @property
    def staging(self) -> torch.Tensor:
        """A new scratch buffer of the bank's size (``uint8``) for the raw broadcast, never the served bank."""
        return self.layout.allocate(self.adapter.device)

    def memory(self) -> Any:
        """The adapter's :class:`ckpt.serving.AdapterMemory` (one bank, no staging bank)."""
        return self.adapter.memory()

    async def update_weights(self, global_steps: int) -> int | None:
        """Receive and apply ``global_steps``; returns the step served. DeltaRefusedError: refused (atomic: the
        previous step still served)."""
        from ckpt.delta import receive_delta

        if self.reports:
            self.engine.promise_reports()
        try:
            served = await receive_delta(self.engine, self.receiver, global_steps)
        except Exception as exc:
            await self._report(exc)
            raise
        await self._report(None)
        return served

    async def _report(self, error: BaseException | None) -> None:
        if self.reports:
            with contextlib.suppress(Exception):  # not heard: the trainer's wait names this rollout
                await asyncio.to_thread(self.engine.report_outcome, error, self.state_dict)


def receiver_memory(atomic: bool, model_bytes: int, largest_tensor_bytes: int, flush_bytes: int
                    ) -> tuple[str, dict[str, int]]:
    """What a delta receiver holds while applying an update beside its bank and buckets: ``(words, {term:
    bytes})`` (atomic: the staged update; in place: the flush, its positions and checksum temporaries)."""
    flush = max(flush_bytes, largest_tensor_bytes)
    if atomic:
        return ("the staged delta (2 x model) + one tensor's scratch",
                {"delta_staged_bytes": STAGED_FACTOR * model_bytes, "delta_scratch_bytes": largest_tensor_bytes})
    return ("one delta flush and its positions (3 x a flush) + one tensor's scratch",
            {"delta_flush_bytes": 3 * flush, "delta_scratch_bytes": largest_tensor_bytes})


def sender_memory(snapshot_bytes: int, largest_tensor_bytes: int, flush_bytes: int) -> tuple[str, dict[str, int]]:
    """What the trainer's :class:`ckpt.delta.DeltaSender` holds: ``(words, {term: bytes})`` (its snapshot, two
    flushes, one tensor's diff temporaries)."""
    flush = max(flush_bytes, largest_tensor_bytes)
    return ("the delta snapshot (host) + 2 delta flushes + one tensor's diff",
            {"delta_snapshot_bytes": snapshot_bytes, "delta_flushes_bytes": 2 * flush,
             "delta_diff_bytes": 3 * largest_tensor_bytes})


def reseed_reason(received: Sequence[Any]) -> str | None:
    """Why the trainer must re-seed the next update (the rollouts whose receiver needs a seed), or ``None``."""
    needing = [r for r in received if getattr(r, "needs_seed", None)]
    if not needing:
        return None
    return "; ".join(f"rollout rank {r.rank} needs a seed ({r.error or 'no base'})" for r in needing)


__all__ = ["DeltaServing", "STAGED_FACTOR", "WIRE_FORMATS", "flush_bytes", "receiver_memory", "reseed_reason", "sender_memory",
           "single_bank"]
