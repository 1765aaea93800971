"""Where an engine's parameters, gradients and optimizer states live, as plain data."""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch

# The value of a TensorHome field when one part's tensors live on more than one device.
MIXED = "mixed"


@dataclasses.dataclass(frozen=True)
class TensorHome:
    """The ``torch.device`` type (``"npu"``, ``"cuda"``, ``"cpu"``) each part of an engine lives on (local shards).

    ``None``: no tensors (no optimizer, no gradients). ``optimizer`` ignores host scalars like Adam's ``step``,
    and before the first step says where the state will be created.
    """

    model: str | None
    optimizer: str | None
    grad: str | None


def device_type_of(tensors: Iterable[torch.Tensor]) -> str | None:
    """Return the device type of ``tensors`` on one device, ``"mixed"`` across devices, ``None`` when empty."""
    devices = {(t.device.type, t.device.index) for t in tensors}
    if not devices:
        return None
    return devices.pop()[0] if len(devices) == 1 else MIXED
