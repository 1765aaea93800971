"""hal on Ray: workers as Ray actors placed by the kind's Ray resource (:mod:`hal.ray.placement`), and the
clusters hal's jobs start or join (:mod:`hal.ray.cluster`). Imports ``ray`` only inside its functions.
"""

from hal.ray.cluster import (
    AF_UNIX_PATH_MAX,
    CONNECT_TIMEOUT_S,
    DEFAULT_OBJECT_STORE_BYTES,
    LocalCluster,
    connect_cluster,
    ray_temp_parent,
)
from hal.ray.placement import (
    NOSET_PREFIX,
    RAY_UNIT_INSTANCE_DEFAULT,
    SCHEDULE_AS_ENV,
    STRATEGIES,
    UNIT_INSTANCE_ENV,
    DeviceBinding,
    RayLaunchError,
    WorkerPlacement,
    actor_resources,
    bind_assigned_device,
    check_distinct_devices,
    node_environment,
    place_workers,
    ray_sets_visible_devices,
    require_ray,
    resource_name,
    resource_request,
    schedule_as,
    Strategy,
)

__all__ = [
    "STRATEGIES", "UNIT_INSTANCE_ENV", "SCHEDULE_AS_ENV", "RayLaunchError", "require_ray", "resource_name",
    "schedule_as", "ray_sets_visible_devices", "node_environment", "resource_request", "actor_resources",
    "WorkerPlacement", "place_workers", "DeviceBinding", "bind_assigned_device", "check_distinct_devices",
    "LocalCluster", "CONNECT_TIMEOUT_S", "connect_cluster", "AF_UNIX_PATH_MAX", "ray_temp_parent",
    "Strategy", "NOSET_PREFIX", "RAY_UNIT_INSTANCE_DEFAULT", "DEFAULT_OBJECT_STORE_BYTES",
]
