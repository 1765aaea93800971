"""The simulated npu's IPC: a device buffer another process opens in place, as torch_npu's IPC does on Ascend.

A shareable device buffer is a shared-memory segment viewed as an ``npu`` tensor; its handle follows torch's
``reduce_tensor`` convention (device index at ``args[6]``), so verl's ``rebuild_ipc`` opens it. The reported
driver and CANN versions decide, as on Ascend, whether this path or shared memory is taken.
"""

from __future__ import annotations

import torch

from devices.ipc import DEVICE_INDEX_ARG, SharedDeviceBuffer
from devices.shared_memory import SharedSegment, attach

# Names of the segments behind shared simulated device buffers (/dev/shm/hal-npusim-ipc-*).
SEGMENT_PREFIX = "hal-npusim-ipc-"


def _alias(host: torch.Tensor, index: int) -> torch.Tensor:
    """Return an npu view of ``host`` on device ``index``."""
    from devices.npu_sim import ext

    return ext.load().device_alias(host, index)


def share_buffer(nbytes: int, device: torch.device) -> SharedDeviceBuffer:
    """Return a flat ``uint8`` npu buffer of ``nbytes`` on ``device`` that :func:`open_shared` opens elsewhere.

    ``release`` unlinks the segment's name; the memory goes with the last tensor over it, in any process.
    """
    segment = SharedSegment(nbytes, SEGMENT_PREFIX)
    index = 0 if device.index is None else device.index
    args = [segment.name, nbytes, 0, 0, 0, 0, index]
    if args[DEVICE_INDEX_ARG] != index:  # the layout is the convention's, not ours to move
        raise RuntimeError("devices.ipc.DEVICE_INDEX_ARG moved; update the sim's handle layout")
    return SharedDeviceBuffer(_alias(segment.tensor, index), (open_shared, tuple(args)), segment.unlink, segment.name)


def open_shared(name: str, nbytes: int, _a: int, _b: int, _c: int, _d: int, device_index: int) -> torch.Tensor:
    """Open a buffer of :func:`share_buffer` as a flat ``uint8`` npu tensor on ``device_index``."""
    return _alias(attach(name, nbytes), int(device_index))


__all__ = ["SEGMENT_PREFIX", "open_shared", "share_buffer"]
