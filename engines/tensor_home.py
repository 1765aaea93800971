"""Where an engine's parameters, gradients and optimizer states live, as plain data."""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch

MIXED = "mixed"
"""The value of a :class:`TensorHome` field when the tensors of one part live on more than one device type."""


@dataclasses.dataclass(frozen=True)
class TensorHome:
    """The ``torch.device`` type (``"npu"``, ``"cuda"``, ``"cpu"``) each part of an engine lives on.

    Fields:
        model: where parameters and buffers live; ``"mixed"`` if they are split across device types or
            indices (only after a failed move); ``None`` for a module with no tensors. The index itself is
            the engine's ``torch_device``.
        optimizer: where the optimizer-state tensors live. 0-dim host tensors that the optimizer itself
            keeps on the host (Adam's ``step`` when not ``capturable``/``fused``) are not counted. For an
            optimizer that has no state yet (never stepped) this is where its state will be created or was
            last asked to be (the engine's device type, or ``"cpu"`` after an offload). ``None`` when the
            engine has no optimizer.
        grad: where the gradient buffers live; ``None`` when no parameter holds a gradient.

    For sharded engines (FSDP) the value describes the local shards of this rank.
    """

    model: str | None
    optimizer: str | None
    grad: str | None


def device_type_of(tensors: Iterable[torch.Tensor]) -> str | None:
    """The device type of ``tensors`` when they all live on one device, ``"mixed"`` when they do not (other
    types, or two indices of one type: ``npu:0`` and ``npu:1``), ``None`` when empty."""
    devices = {(t.device.type, t.device.index) for t in tensors}
    if not devices:
        return None
    return devices.pop()[0] if len(devices) == 1 else MIXED
