"""The simulated npu's IPC: a device buffer another process opens in place, as torch_npu's IPC does on Ascend.

The sim's device memory is host memory of one process, so a shareable device buffer is a shared-memory segment
(:class:`devices.shared_memory.SharedSegment`) viewed as an ``npu`` tensor (the extension's ``device_alias``).
Its handle follows torch's ``reduce_tensor`` convention (``(rebuild_fn, args)`` with the device index at
``args[6]``), so a receiver written for CUDA IPC, verl's ``rebuild_ipc`` included, opens it on its own device
index. Whether the sim takes this path or shared memory plus a host-to-device copy is decided, as on Ascend, by the
driver and CANN versions it reports (:mod:`devices.npu_sim.cann`, ``HAL_SIM_DRIVER_VERSION``,
``HAL_SIM_CANN_VERSION``).
"""

from __future__ import annotations

import torch

from devices.ipc import DEVICE_INDEX_ARG, SharedDeviceBuffer
from devices.shared_memory import SharedSegment, attach

SEGMENT_PREFIX = "hal-npusim-ipc-"
"""Names of the segments behind shared simulated device buffers (``/dev/shm/hal-npusim-ipc-*``)."""


def _alias(host: torch.Tensor, index: int) -> torch.Tensor:
    """An npu view of ``host`` on ``index``; the sim is registered in any process that has npu tensors."""
    from devices.npu_sim import ext

    return ext.load().device_alias(host, index)


def share_buffer(nbytes: int, device: torch.device) -> SharedDeviceBuffer:
    """A flat ``uint8`` npu buffer of ``nbytes`` on ``device`` that :func:`open_shared` opens in another process.

    ``release`` unlinks the segment's name; the memory goes when the last tensor over it, here or there, is freed.

    Raises:
        ValueError: ``nbytes`` not positive. OSError: ``/dev/shm`` cannot hold it.
    """
    segment = SharedSegment(nbytes, SEGMENT_PREFIX)
    index = 0 if device.index is None else device.index
    args = [segment.name, nbytes, 0, 0, 0, 0, index]
    if args[DEVICE_INDEX_ARG] != index:  # the layout is the convention's, not ours to move
        raise RuntimeError("devices.ipc.DEVICE_INDEX_ARG moved; update the sim's handle layout")
    return SharedDeviceBuffer(_alias(segment.tensor, index), (open_shared, tuple(args)), segment.unlink, segment.name)


def open_shared(name: str, nbytes: int, _a: int, _b: int, _c: int, _d: int, device_index: int) -> torch.Tensor:
    """Open a buffer of :func:`share_buffer` as a flat ``uint8`` npu tensor on ``device_index`` of this process.

    Raises:
        FileNotFoundError: the sender released it (or died). ValueError: the segment is smaller than ``nbytes``.
    """
    return _alias(attach(name, nbytes), int(device_index))


__all__ = ["SEGMENT_PREFIX", "open_shared", "share_buffer"]
