"""hal: one device API for cuda (NCCL), Ascend npu (HCCL) and cpu (gloo).

Importing ``hal`` probes no hardware and imports no vendor package; the first call does, and caches.
:class:`DeviceSpec` is the type of a device kind's facts (what :func:`resolve_device` returns);
:mod:`hal.torch_compat` holds the accessors of torch's private names that trainer engines need.
"""

from devices.base import DeviceSpec
from hal.device import (
    ENV_VAR,
    Availability,
    availability,
    available_kinds,
    check_index,
    describe,
    empty_cache,
    get_device,
    get_device_id,
    get_device_name,
    get_dist_backend,
    get_torch_device,
    get_visible_devices_keyword,
    LocalDevice,
    resolve_local_device,
    manual_seed,
    memory_stats,
    reset,
    resolve_device,
    set_device,
    split_device,
    synchronize,
)
from hal.distributed import (
    DEFAULT_TIMEOUT_S,
    StoreGroup,
    connect_store,
    init_process_group,
    launcher_store,
    new_group_from_store,
    process_alive,
)
from hal.errors import (
    DeviceIndexError,
    DeviceUnavailableError,
    DistributedTimeoutError,
    DuplicateDeviceError,
    HalError,
    UnknownDeviceError,
)
from devices.cpu import is_host
from hal.registry import known_kinds, plugin_errors, register_device, unregister_device

__all__ = [
    "ENV_VAR", "DEFAULT_TIMEOUT_S",
    "resolve_device", "get_device", "get_device_name", "get_torch_device", "get_device_id", "get_dist_backend",
    "get_visible_devices_keyword", "set_device", "is_host",
    "LocalDevice", "resolve_local_device", "split_device", "check_index",
    "synchronize", "empty_cache", "memory_stats", "manual_seed",
    "init_process_group", "new_group_from_store", "connect_store", "launcher_store", "StoreGroup", "process_alive",
    "DeviceSpec", "Availability", "availability", "available_kinds", "known_kinds", "describe", "reset",
    "register_device", "unregister_device", "plugin_errors",
    "HalError", "UnknownDeviceError", "DeviceUnavailableError", "DeviceIndexError", "DuplicateDeviceError", "DistributedTimeoutError",
]
