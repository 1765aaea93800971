"""Same-host buffer sharing between processes, re-exported from :mod:`devices.ipc` and :mod:`devices.shared_memory`."""

from devices.ipc import DEVICE_INDEX_ARG, TRANSPORTS, SharedDeviceBuffer, is_handle as is_ipc_handle
from devices.ipc import open_handle as open_ipc_handle
from devices.shared_memory import SharedSegment, segments as shared_segments
from devices.shared_memory import attach as attach_shared_segment
from devices.shared_memory import unlink as unlink_shared_segment

__all__ = ["DEVICE_INDEX_ARG", "TRANSPORTS", "SharedDeviceBuffer", "SharedSegment", "attach_shared_segment",
           "is_ipc_handle", "open_ipc_handle", "shared_segments", "unlink_shared_segment"]
