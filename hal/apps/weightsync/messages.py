"""The typed messages of one weight-sync step, as the launchers carry them between the roles.

Times ending in ``_at`` or named ``t0`` are wall-clock (``time.time()``) seconds; ``*_s`` are durations in
seconds; ``*_bytes`` are bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


@dataclasses.dataclass
class Trained:
    """The trainer's part of a step before the publish: its optimizer step, offload and cast."""

    global_steps: int
    loss: float
    train_s: float
    offload_s: float
    # where model, gradients and optimizer states live after the offload (engines.TensorHome as a dict)
    tensor_home: dict[str, Any]
    stage_s: float


@dataclasses.dataclass
class Sent:
    """The trainer's ``update_weights`` result: when its send started (``t0``) and how long it took."""

    t0: float
    send_s: float
    delta: dict[str, Any] | None = None  # delta: ckpt.delta.UpdateStats as a dict
    refused: dict[str, str] | None = None  # rollouts that told the trainer they applied nothing: {who: cause}
    # a weight-checked step: {"checked": rollouts that answered, "mismatches": {who: [sentence, ...]}}
    check: dict[str, Any] | None = None
    nbytes: int | None = None  # bytes and tensors of this publish where they vary per step (LoRA)
    tensors: int | None = None
    lora: dict[str, Any] | None = None  # LoRA: hal.apps.weightsync.lora.LoraPublisher.figures


@dataclasses.dataclass
class Reference:
    """What the rollouts are checked against: the trainer's CRC-32 per tensor (``sums``) and, for presets, its
    greedy decode (``tokens``; ``logits`` float32 on the host)."""

    sums: dict[str, str]
    tokens: list[int] | None = None
    logits: torch.Tensor | None = None
    # LoRA adapters: the largest |logits difference| the adapter makes against the base alone (what it proves)
    adapter_logits_shift: float | None = None


@dataclasses.dataclass
class Received:
    """A rollout's ``update_weights`` result: the step it serves, the transfer's error and its figures
    (``memory`` is ``None`` when colocated)."""

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
    # a vLLM rollout's figures measured inside its worker (startup_s, receive_s, load_s, bytes)
    vllm: dict[str, Any] | None = None
    needs_seed: bool | None = None  # delta: the receiver takes only a seed next
    needs_base: bool | None = None  # LoRA adapters: the rollout serves no base (the next publish must carry it)
    device: str | None = None  # "npu:1"
    received_bytes: int | None = None  # a tensor-parallel rank: the bytes of its slices (the rest never came)


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


def merge_sent(sent: list[Sent]) -> Sent:
    """The trainer's send of an update from each rank's: ``t0`` the latest start, ``send_s`` the longest."""
    if len(sent) == 1:
        return sent[0]
    refused = {k: v for s in sent for k, v in (s.refused or {}).items()} or None
    checks = [s.check for s in sent if s.check is not None]
    check = None if not checks else {"checked": min(c["checked"] for c in checks),
                                     "mismatches": {k: v for c in checks for k, v in c["mismatches"].items()}}
    return Sent(t0=max(s.t0 for s in sent), send_s=max(s.send_s for s in sent), delta=sent[0].delta,
                refused=refused, check=check, nbytes=sent[0].nbytes, tensors=sent[0].tensors, lora=sent[0].lora)


def merge_references(references: list[Reference]) -> Reference:
    """The trainer's reference from each rank's: every rank's checksums (disjoint keys), rank 0's decode."""
    if len(references) == 1:
        return references[0]
    sums: dict[str, str] = {}
    for reference in references:
        sums.update(reference.sums)
    first = references[0]
    return Reference(sums, first.tokens, first.logits, first.adapter_logits_shift)


# fields of Received that serve the timing and the colocated bound, not the row
WHEN_FIELDS = ("started_at", "applied_at", "held_bytes")


def rollout_row(received: Received, checked: Checked) -> dict[str, Any]:
    """A rollout's entry in a step's row: :class:`Received`'s fields but the timing and unset ones, then
    :class:`Checked`'s."""
    row = {k: v for k, v in dataclasses.asdict(received).items()
           if k not in WHEN_FIELDS and (v is not None or k in ("served_step", "error"))}
    row.update(dataclasses.asdict(checked))
    row["error"] = received.error or checked.error
    return row


__all__ = ["Checked", "Concluded", "Received", "Reference", "Sent", "Trained", "merge_references",
           "merge_sent", "rollout_row"]
