"""Delta weight sync in the job (``hal sync --wire-format delta``): the rollout's side, its memory, and the
fault policy that decides when the trainer re-seeds.

The trainer publishes through :func:`ckpt.delta.delta_send` with a :class:`ckpt.delta.DeltaSender` it keeps
across steps (:class:`~hal.apps.weightsync.trainer.Trainer`). Each rollout applies the update with a
:class:`ckpt.delta.DeltaReceiver` straight onto its served model's tensors (:class:`DeltaServing`), not through
:class:`ckpt.ModelRolloutAdapter`'s banks: a delta carries only the changed values, so it cannot be loaded
into a second bank (which holds a step older than the one served), and the receiver's own atomic mode
already stages the update and writes it only once every checksum matched. So the adapter here holds the
served model in one bank (it gives the layout, ``state_dict()`` and the memory facts), and the receiver is
atomic or in place as ``--rollout-apply`` says. A refused atomic update leaves the previous step served
(``served_step`` unchanged); a refused in-place one leaves no step served (``served_step`` is ``None``).

Fault policy (:func:`reseed_reason`, run by the step loop, :class:`~hal.apps.weightsync.loop.Job`): every
rollout reports whether its receiver needs a full seed (a refused update, a transfer that failed, a receiver
that just started); when one does, the trainer re-seeds the next update. The loop also re-seeds after a step
that failed (a rollout may hold a partial update) and when a rollout was replaced (a new member: the topology
changed). Step 0 is a seed: a new sender and new receivers hold no base.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

WIRE_FORMATS = ("full", "delta")
"""``--wire-format`` choices: ``full`` sends every tensor each step; ``delta`` sends verl's ``delta_flush``."""

STAGED_FACTOR = 2
"""An atomic delta receiver stages at most this many times the model's bytes: the values plus their int64
positions of a tensor that stays sparse (fewer than ``numel * es / (4 + es)`` changed values, so
``(es + 8) * changed < 2 * numel * es`` for every element size ``es >= 1``); a seed stages 1 x model."""


def flush_bytes(bucket_bytes: int) -> int:
    """The sender's flush size for an engine of ``bucket_bytes`` buckets: half a bucket (as
    :class:`ckpt.delta.DeltaCheckpointEngine` chooses), so a flush's positions and values fit one bucket."""
    return max(1, bucket_bytes // 2)


def single_bank(module: torch.nn.Module, atomic: bool = True) -> Any:
    """The served model in a one-bank :class:`ckpt.ModelRolloutAdapter` (``atomic`` is the receiver's, not
    the adapter's: a delta is staged by :class:`ckpt.delta.DeltaReceiver`, see the module docstring)."""
    import ckpt

    return ckpt.ModelRolloutAdapter(module, atomic=False)


class DeltaServing:
    """A rollout's served model taking ``delta_flush`` updates from ``engine`` (see the module docstring).

    Has what the job reads of a rollout adapter: ``served_step``, ``degraded``, ``state_dict()``,
    ``memory()``, ``layout``, ``device`` and ``staging`` (a scratch buffer, never the served bank).

    Args:
        adapter: a one-bank :class:`ckpt.ModelRolloutAdapter` holding the served model (:func:`single_bank`).
        engine: the rollout's receiving checkpoint engine (named tensors).
        atomic: the receiver's mode (``--rollout-apply atomic``: a refused update leaves the previous step
            served).
    """

    def __init__(self, adapter: Any, engine: Any, atomic: bool) -> None:
        from ckpt.delta import DeltaReceiver

        self.adapter, self.engine, self.atomic = adapter, engine, bool(atomic)
        self.receiver = DeltaReceiver(adapter.state_dict(), atomic=self.atomic)
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
        """A new scratch buffer of the bank's size (``uint8``) for the raw reference's broadcast, which must
        not land in the served bank (a delta would then be applied onto the step's own bytes)."""
        return self.layout.allocate(self.adapter.device)

    def memory(self) -> Any:
        """The adapter's :class:`ckpt.serving.AdapterMemory` (one bank, no staging bank)."""
        return self.adapter.memory()

    async def update_weights(self, global_steps: int) -> int | None:
        """Receive and apply ``global_steps`` (:func:`ckpt.delta.receive_delta`); returns the step served.

        Raises:
            DeltaRefusedError: refused (checksum, base step, layout); atomic: the previous step is still
                served. Whatever the engine raises (the receiver's update is then aborted).
        """
        from ckpt.delta import receive_delta

        return await receive_delta(self.engine, self.receiver, global_steps)


def receiver_memory(atomic: bool, model_bytes: int, largest_tensor_bytes: int, flush_bytes: int
                    ) -> tuple[str, dict[str, int]]:
    """What a delta receiver holds while it applies an update, ``(words, {term: bytes})``, beside its one bank
    and the engine's receive buckets.

    Atomic: the staged update (:data:`STAGED_FACTOR` x model: ``DeltaReceiver`` keeps each tensor's values and
    int64 positions until the last flush) plus one tensor's scratch result. In place: the flush being applied
    (a copy owned by the receiver, ``max(flush_bytes, largest tensor)``) and its int64 positions (2 x a flush
    at most), plus one tensor's checksum temporaries (1 x the largest tensor).
    """
    flush = max(flush_bytes, largest_tensor_bytes)
    if atomic:
        return ("the staged delta (2 x model) + one tensor's scratch",
                {"delta_staged_bytes": STAGED_FACTOR * model_bytes, "delta_scratch_bytes": largest_tensor_bytes})
    return ("one delta flush and its positions (3 x a flush) + one tensor's scratch",
            {"delta_flush_bytes": 3 * flush, "delta_scratch_bytes": largest_tensor_bytes})


def sender_memory(snapshot_bytes: int, largest_tensor_bytes: int, flush_bytes: int) -> tuple[str, dict[str, int]]:
    """What the trainer's :class:`ckpt.delta.DeltaSender` holds, ``(words, {term: bytes})``: its snapshot of
    the published values (host; the published bytes once seeded, counted from the first update on), the two
    flushes it holds (the one being filled and the one held back to learn which is last, each
    ``max(flush_bytes, largest tensor)``, positions included), and one tensor's diff temporaries (its snapshot
    copied to the device, the bit mask and the changed positions: 3 x the largest tensor)."""
    flush = max(flush_bytes, largest_tensor_bytes)
    return ("the delta snapshot (host) + 2 delta flushes + one tensor's diff",
            {"delta_snapshot_bytes": snapshot_bytes, "delta_flushes_bytes": 2 * flush,
             "delta_diff_bytes": 3 * largest_tensor_bytes})


def reseed_reason(received: Sequence[Any]) -> str | None:
    """The fault policy's word on one update's results (:class:`~hal.apps.weightsync.messages.Received`):
    why the trainer must re-seed the next update (the rollouts whose receiver needs a seed, with their
    errors), or ``None``."""
    needing = [r for r in received if getattr(r, "needs_seed", None)]
    if not needing:
        return None
    return "; ".join(f"rollout rank {r.rank} needs a seed ({r.error or 'no base'})" for r in needing)


__all__ = ["DeltaServing", "STAGED_FACTOR", "WIRE_FORMATS", "flush_bytes", "receiver_memory", "reseed_reason", "sender_memory",
           "single_bank"]
