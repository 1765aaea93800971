"""Sharing one device buffer with another process of the same host: what a device kind's IPC gives.

Two transports exist for a same-host weight hand-over (:mod:`ckpt.ipc`), and which one a kind takes is a fact of
the kind (:meth:`devices.base.DeviceSpec.ipc_transport`):

* ``"device"``: the sender allocates a bucket in device memory and exports it as a handle; the receiver opens
  the handle on its own device index and reads the sender's memory in place (CUDA IPC; torch_npu's IPC on
  Ascend where the driver and CANN allow it; the simulated npu's own, over a shared-memory segment).
* ``"shm"``: the bucket is a POSIX shared-memory segment in host memory; a device receiver copies each bucket
  to its device (host to device), as verl does on Ascend stacks without IPC (verl PR 5089).

A handle is torch's convention, as verl's and vLLM's senders use it: ``(rebuild_fn, args)`` from
``torch.multiprocessing.reductions.reduce_tensor``, where ``args[6]`` is the device index; a receiver swaps in
its own index before calling ``rebuild_fn(*args)`` (verl ``bucketed_weight_transfer.rebuild_ipc``, copied there
from vLLM's ``examples/offline_inference/rlhf_utils.py``), since the two processes may see different visible
devices.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

DEVICE_INDEX_ARG = 6
"""Position of the device index in a handle's ``args`` (torch's ``rebuild_cuda_tensor`` signature)."""
TRANSPORTS = ("device", "shm")
"""The values :meth:`devices.base.DeviceSpec.ipc_transport` may return."""


@dataclasses.dataclass
class SharedDeviceBuffer:
    """A flat ``uint8`` device buffer another process can open.

    Attributes:
        tensor: the buffer (``nbytes`` bytes, ``uint8``, on the kind's device).
        handle: picklable ``(rebuild_fn, args)``; :func:`open_handle` rebuilds the buffer from it.
        release: frees what the export holds beyond the tensor (``None``: nothing; the tensor's own reference
            count frees its memory).
        segment: the shared-memory segment behind the buffer, where there is one (the simulated npu), for leak
            checks; ``None`` where the runtime keeps device memory itself (CUDA, Ascend).
    """

    tensor: torch.Tensor
    handle: tuple[Callable[..., torch.Tensor], tuple]
    release: Callable[[], None] | None = None
    segment: str | None = None


def share_with_torch(nbytes: int, device: torch.device) -> SharedDeviceBuffer:
    """A device buffer exported with torch's ``reduce_tensor`` (CUDA, and torch_npu where it supports IPC).

    Raises:
        RuntimeError: the kind's runtime cannot export device memory (torch's or the vendor's message).
    """
    from torch.multiprocessing.reductions import reduce_tensor

    tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return SharedDeviceBuffer(tensor, reduce_tensor(tensor))


def is_handle(value: Any) -> bool:
    """Whether ``value`` has the shape of a device handle: ``(callable, tuple of more than 6 items)``."""
    return (isinstance(value, tuple) and len(value) == 2 and callable(value[0]) and isinstance(value[1], tuple)
            and len(value[1]) > DEVICE_INDEX_ARG)


def open_handle(handle: tuple[Callable[..., torch.Tensor], tuple], device_index: int | None) -> torch.Tensor:
    """The buffer a handle names, opened on ``device_index`` of this process (``None``: the index it carries).

    Raises:
        ValueError: ``handle`` is not ``(rebuild_fn, args)`` with a device index at ``args[6]``.
        RuntimeError: the runtime could not open it (the sender's memory is gone, another host).
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
