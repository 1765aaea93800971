"""The typed messages of one weight-sync step, as the launchers carry them between the roles (pickled over
ZeroMQ under torchrun, Ray's serialization under Ray, as objects in one process when colocated).

Times ending in ``_at`` or named ``t0`` are wall-clock (``time.time()``, seconds), comparable across
processes of one machine; ``*_s`` are durations in seconds; ``*_bytes`` are bytes.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import torch


@dataclasses.dataclass
class Trained:
    """The trainer's part of a step before the publish: its optimizer step, offload and cast."""

    global_steps: int
    loss: float
    train_s: float
    offload_s: float
    tensor_home: dict[str, Any]
    """Where the model, gradients and optimizer states live after the offload (engines.TensorHome as a dict)."""
    stage_s: float


@dataclasses.dataclass
class Sent:
    """The trainer's ``update_weights`` result: when its send started (``t0``) and how long it took."""

    t0: float
    send_s: float
    delta: dict[str, Any] | None = None
    """``--wire-format delta``: the update's ``ckpt.delta.UpdateStats`` as a dict (``None``: a full update)."""


@dataclasses.dataclass
class Reference:
    """What the rollouts are checked against: the trainer's CRC-32 per tensor (``sums``, ``{name: hex}``)
    and, for presets, its own bf16 model's greedy decode (``tokens``; ``logits``: ``(len(tokens), vocab)``
    float32 on the host)."""

    sums: dict[str, str]
    tokens: list[int] | None = None
    logits: torch.Tensor | None = None


@dataclasses.dataclass
class Received:
    """A rollout's ``update_weights`` result: the step it serves, the transfer's error (``None``: none) and
    its figures. ``memory`` (its peak against :func:`hal.apps.weightsync.memory.rollout_memory_bounds`) is
    ``None`` where the rollout shares its process (colocated). ``held_bytes`` is what its weight banks hold."""

    rank: int
    served_step: int | None
    error: str | None
    receive_s: float
    copied_bytes: int
    started_at: float
    applied_at: float
    held_bytes: int
    peak_host_bytes: int | None = None
    peak_device_bytes: int | None = None
    memory: dict[str, Any] | None = None
    memory_bound_bytes: int | None = None
    node_ip: str | None = None
    device_id: str | None = None
    vllm: dict[str, Any] | None = None
    """A vLLM rollout's own figures (:class:`~hal.apps.weightsync.vllm_role.VllmRolloutRole`): ``startup_s``,
    ``receive_s`` and ``load_s`` measured inside vLLM's worker, ``bytes``; ``None`` for hal's rollout."""
    needs_seed: bool | None = None
    """``--wire-format delta``: the receiver takes only a full seed next (``None``: full updates)."""
    device: str | None = None
    """The device the rollout serves on (``"npu:1"``; every rollout's ``"npu:0"`` with ``--hybrid``)."""


@dataclasses.dataclass
class Checked:
    """A rollout's verification after an update (:func:`hal.apps.weightsync.verify.verify_rollout`)."""

    error: str | None = None
    tokens: list[int] | None = None
    tokens_equal: bool | None = None
    logits_max_diff: float | None = None
    verify_s: float = 0.0


@dataclasses.dataclass
class Concluded:
    """The trainer's end of a step: onload time, its peaks and the bound it is judged by."""

    onload_s: float
    peak_device_bytes: int
    peak_host_bytes: int
    memory: dict[str, Any]


def load_message(data: bytes) -> tuple[Any, str | None]:
    """``(message, None)`` from ``data`` (one message's pickle), or ``(None, why)`` where it does not load in this
    process (``why``: ``"ExceptionType: message"``): a class only the sender can import (one of its ``__main__``,
    say) fails that one call or reply, not the process that read it. The launchers pickle a call's or a reply's
    content apart from its sequence number for this."""
    try:
        return pickle.loads(data), None
    except Exception as exc:  # noqa: BLE001 - any load failure is that one message's, reported to its caller
        return None, f"{type(exc).__name__}: {exc}"


def merge_sent(sent: list[Sent]) -> Sent:
    """The trainer's send of an update from each trainer rank's: the update is in flight once the last sender
    started (``t0``: the latest), and sent when the slowest finished (``send_s``: the longest)."""
    if len(sent) == 1:
        return sent[0]
    return Sent(t0=max(s.t0 for s in sent), send_s=max(s.send_s for s in sent), delta=sent[0].delta)


def merge_references(references: list[Reference]) -> Reference:
    """The trainer's reference from each trainer rank's: every rank's checksums (their keys are disjoint: each
    names a rank's rows), rank 0's decode (every rank decodes the same published module)."""
    if len(references) == 1:
        return references[0]
    sums: dict[str, str] = {}
    for reference in references:
        sums.update(reference.sums)
    first = references[0]
    return Reference(sums, first.tokens, first.logits)


WHEN_FIELDS = ("started_at", "applied_at", "held_bytes")
"""Fields of :class:`Received` that serve the timing and the colocated bound, not the row."""


def rollout_row(received: Received, checked: Checked) -> dict[str, Any]:
    """A rollout's entry in a step's row (``--json``): :class:`Received`'s fields but the timing ones and
    those left unset (``None``: no memory colocated, no node outside Ray), then :class:`Checked`'s; a
    transfer error stays the error reported."""
    row = {k: v for k, v in dataclasses.asdict(received).items()
           if k not in WHEN_FIELDS and (v is not None or k in ("served_step", "error"))}
    row.update(dataclasses.asdict(checked))
    row["error"] = received.error or checked.error
    return row


__all__ = ["Checked", "Concluded", "Received", "Reference", "Sent", "Trained", "load_message", "merge_references",
           "merge_sent", "rollout_row"]
