"""Sharing one device buffer with another process of the same host: what a device kind's IPC gives.

A kind's transport (:meth:`devices.base.DeviceSpec.ipc_transport`) is ``"device"`` (a device buffer exported
as a handle, read in place by the receiver) or ``"shm"`` (a host shared-memory segment the receiver copies to
its device, as verl does on Ascend stacks without IPC). A handle is torch's ``(rebuild_fn, args)`` from
``reduce_tensor``, ``args[6]`` the device index, which a receiver replaces with its own before
``rebuild_fn(*args)`` (as verl's ``rebuild_ipc`` and vLLM's rlhf example do).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

# Position of the device index in a handle's args (torch's rebuild_cuda_tensor signature).
DEVICE_INDEX_ARG = 6
# The values DeviceSpec.ipc_transport may return.
TRANSPORTS = ("device", "shm")


@dataclasses.dataclass
class SharedDeviceBuffer:
    """A flat ``uint8`` device buffer another process can open from :attr:`handle`.

    ``release`` frees what the export holds beyond the tensor (``None``: nothing). ``segment`` is the
    shared-memory segment behind it where there is one (npu-sim), for leak checks.
    """

    tensor: torch.Tensor
    handle: tuple[Callable[..., torch.Tensor], tuple]
    release: Callable[[], None] | None = None
    segment: str | None = None


def share_with_torch(nbytes: int, device: torch.device) -> SharedDeviceBuffer:
    """Return a device buffer exported with torch's ``reduce_tensor`` (CUDA, and torch_npu where it has IPC)."""
    from torch.multiprocessing.reductions import reduce_tensor

    tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return SharedDeviceBuffer(tensor, reduce_tensor(tensor))


def is_handle(value: Any) -> bool:
    """Return whether ``value`` has the shape of a device handle: ``(callable, tuple of more than 6 items)``."""
    return (isinstance(value, tuple) and len(value) == 2 and callable(value[0]) and isinstance(value[1], tuple)
            and len(value[1]) > DEVICE_INDEX_ARG)


def open_handle(handle: tuple[Callable[..., torch.Tensor], tuple], device_index: int | None) -> torch.Tensor:
    """Open the buffer a handle names on ``device_index`` of this process (``None``: the index it carries).

    ValueError for a malformed handle; RuntimeError when the runtime cannot open it (sender's memory gone).
    """
    if not is_handle(handle):
        raise ValueError(f"an IPC handle must be (rebuild_fn, args) with the device index at args[{DEVICE_INDEX_ARG}], "
                         f"got {type(handle).__name__}")
    func, args = handle
    args = list(args)
    if device_index is not None:
        args[DEVICE_INDEX_ARG] = device_index
    return func(*args)


__all__ = ["DEVICE_INDEX_ARG", "SharedDeviceBuffer", "TRANSPORTS", "is_handle", "open_handle", "share_with_torch"]
