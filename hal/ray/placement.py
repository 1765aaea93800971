"""Trainer and rollout workers as Ray actors, placed by the device kind's Ray resource.

A worker's bundle asks for the kind's ``ray_resource`` (``GPU``, ``NPU``, the simulated npu's ``NPU_SIM``)
plus CPUs (:func:`resource_request`); :func:`place_workers` reserves a trainer bundle and one per rollout in
one placement group; :func:`bind_assigned_device`, first thing in an actor, binds the device Ray assigned.
Ray sets the visible-devices variable for its own accelerators, hal does for custom resources (both unless
``RAY_EXPERIMENTAL_NOSET_<VARIABLE>``). Custom resources get per-device ids only when listed in
``RAY_custom_unit_instance_resources`` at node start (:func:`node_environment`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Literal, Mapping, Sequence

from hal import registry
from hal.device import ENV_VAR
from hal.errors import HalError

# Ray's placement strategies: pack bundles onto few nodes, or spread them (STRICT_*: or fail).
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]

# Ray's setting listing the custom resources it assigns per-instance ids for (read when a node starts).
UNIT_INSTANCE_ENV = "RAY_custom_unit_instance_resources"
# Ray 2.60's default value of that setting (every entry must stay when one is added).
RAY_UNIT_INSTANCE_DEFAULT = ("neuron_cores", "TPU", "NPU", "HPU", "RBLN", "FURIOSA", "TTNPU", "MBLT")
# RAY_EXPERIMENTAL_NOSET_<VISIBLE_DEVICES_VARIABLE>=1: Ray (and hal) leave that variable alone.
NOSET_PREFIX = "RAY_EXPERIMENTAL_NOSET_"
# kind=RESOURCE[,kind=RESOURCE]: on this node and driver, schedule kind by RESOURCE (npu-sim=NPU).
SCHEDULE_AS_ENV = "HAL_RAY_SCHEDULE_AS"


class RayLaunchError(HalError, RuntimeError):
    """Ray could not place, start or bind a worker (the message names the kind, resource and bundle)."""


def require_ray():
    """Return the ``ray`` module; the ImportError names the extra that installs it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(f"the Ray launcher needs ray (pip install 'hal-posttrain[ray]'): {exc}") from None
    return ray


def resource_name(kind: str) -> str | None:
    """Return the Ray resource ``kind`` is scheduled by (``GPU``, ``NPU``, ``NPU_SIM``; ``None`` for cpu); no probe."""
    spec = registry.get_spec(kind.partition(":")[0].strip().lower())
    if spec.host_memory:
        return None
    return schedule_as().get(spec.kind, spec.ray_resource)


def schedule_as(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return the kinds this process schedules by another Ray resource (``HAL_RAY_SCHEDULE_AS``)."""
    raw = (os.environ if environ is None else environ).get(SCHEDULE_AS_ENV, "")
    out = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        kind, sep, resource = item.partition("=")
        if not sep or not kind.strip() or not resource.strip():
            raise ValueError(f"{SCHEDULE_AS_ENV}: entry {item!r} is not 'kind=RESOURCE'")
        out[kind.strip().lower()] = resource.strip()
    return out


def ray_sets_visible_devices(resource: str) -> bool:
    """Return whether Ray itself sets the visible-devices variable for actors holding ``resource``."""
    from ray._private.accelerators import get_all_accelerator_resource_names  # Ray's own list of them

    return resource in set(get_all_accelerator_resource_names())


def node_environment(kinds: Sequence[str] = (), schedule_as: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return the environment a Ray node needs so that each of ``kinds`` gets per-device ids (``{}`` if none).

    ``schedule_as`` (one kind at most, e.g. ``{"npu-sim": "NPU"}``) runs that kind where Ray and verl place
    Ascend workers; the result then also sets ``HAL_RAY_SCHEDULE_AS`` and ``HAL_DEVICE``.
    """
    overrides = {registry.get_spec(k.strip().lower()).kind: r for k, r in (schedule_as or {}).items()}
    env: dict[str, str] = {}
    if overrides:
        if len(overrides) != 1:
            raise ValueError(f"schedule_as takes one kind (a node has one HAL_DEVICE), got {dict(schedule_as)}")
        env[SCHEDULE_AS_ENV] = ",".join(f"{k}={r}" for k, r in overrides.items())
        env[ENV_VAR] = next(iter(overrides))
    extra = []
    for kind in [*kinds, *overrides]:
        name = overrides.get(registry.get_spec(kind.partition(":")[0].strip().lower()).kind) or resource_name(kind)
        if name and name not in RAY_UNIT_INSTANCE_DEFAULT and name not in ("GPU", "CPU") and name not in extra:
            extra.append(name)
    if extra:
        env[UNIT_INSTANCE_ENV] = ",".join(RAY_UNIT_INSTANCE_DEFAULT + tuple(extra))
    return env


def resource_request(kind: str, cpus: float = 1.0, devices: int = 1) -> dict[str, float]:
    """Return the bundle of one worker on ``kind``: ``{"CPU": cpus, <ray_resource>: devices}`` (cpu: CPUs only)."""
    if cpus < 0:
        raise ValueError(f"cpus must be >= 0, got {cpus}")
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be an int >= 1, got {devices!r}")
    bundle: dict[str, float] = {"CPU": float(cpus)} if cpus else {}
    name = resource_name(kind)
    if name:
        bundle[name] = float(devices)
    return bundle


def actor_resources(bundle: Mapping[str, float]) -> dict[str, Any]:
    """Return the ``ray.remote`` options asking for ``bundle`` (``num_cpus``, ``num_gpus``, ``resources``)."""
    options: dict[str, Any] = {"num_cpus": bundle.get("CPU", 0)}
    if "GPU" in bundle:
        options["num_gpus"] = bundle["GPU"]
    others = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    if others:
        options["resources"] = others
    return options


@dataclasses.dataclass
class WorkerPlacement:
    """A placement group holding the trainer's bundle (index 0) and one bundle per rollout (1..R)."""

    kind: str
    bundles: list[dict[str, float]]
    strategy: str
    group: Any

    @property
    def rollouts(self) -> int:
        return len(self.bundles) - 1

    def options(self, bundle_index: int) -> dict[str, Any]:
        """Return the ``ray.remote`` options running an actor in bundle ``bundle_index`` (0: trainer)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not 0 <= bundle_index < len(self.bundles):
            raise ValueError(f"bundle_index must be in [0, {len(self.bundles)}), got {bundle_index}")
        bundle = {k: v for k, v in self.bundles[bundle_index].items() if not k.startswith("node:")}
        return {**actor_resources(bundle),
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    self.group, placement_group_bundle_index=bundle_index)}

    def node_ids(self) -> list[str]:
        """Return the Ray node id (hex) each bundle was placed on, trainer first."""
        from ray.util.placement_group import placement_group_table

        table = placement_group_table(self.group)
        return [table["bundles_to_node_id"][i] for i in range(len(self.bundles))]

    def remove(self) -> None:
        """Release the group's resources (its actors are killed by Ray)."""
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)


def place_workers(kind: str, rollouts: int, strategy: Strategy = "PACK", cpus: float = 1.0,
                  trainer_node: str | None = None, rollout_node: str | None = None,
                  timeout: float = 60.0) -> WorkerPlacement:
    """Reserve one trainer bundle and ``rollouts`` rollout bundles of ``kind`` and wait until placed.

    ``trainer_node`` / ``rollout_node``: a node IP the bundle must go to. ``timeout`` is in seconds; past it
    RayLaunchError gives the bundles asked for and what the cluster has.
    """
    ray = require_ray()
    from ray.util.placement_group import placement_group, remove_placement_group

    if isinstance(rollouts, bool) or not isinstance(rollouts, int) or rollouts < 1:
        raise ValueError(f"rollouts must be an int >= 1, got {rollouts!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    bundles = [resource_request(kind, cpus) for _ in range(1 + rollouts)]
    for index, node in [(0, trainer_node)] + [(i, rollout_node) for i in range(1, 1 + rollouts)]:
        if node:
            bundles[index][f"node:{node}"] = 0.001
    group = placement_group(bundles, strategy=strategy)
    try:
        ray.get(group.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise RayLaunchError(
            f"could not place {len(bundles)} bundles of device kind {kind!r} ({strategy}) within {timeout:g} s: "
            f"asked for {bundles}; the cluster has {ray.cluster_resources()} in all, "
            f"{ray.available_resources()} free") from None
    return WorkerPlacement(kind, bundles, strategy, group)


@dataclasses.dataclass(frozen=True)
class DeviceBinding:
    """Which device an actor bound, as :func:`bind_assigned_device` found and set it.

    ``ray_ids``: Ray's node-wide ids (strings). ``set_by``: who set the visible-devices variable (``"ray"``,
    ``"hal"``, ``"noset"``, ``None`` on cpu). ``local_index``: the device's index in this process (``LOCAL_RANK``).
    """

    kind: str
    resource: str | None
    ray_ids: tuple[str, ...]
    visible_env: str | None
    visible: str | None
    set_by: str | None
    local_index: int
    device_id: str
    node_id: str
    node_ip: str
    pid: int


def _assigned_ids(ray, resource: str, visible_env: str | None) -> list[str]:
    """Return the ids of ``resource`` Ray assigned to this worker, mapped through the node's visible-devices list."""
    if ray_sets_visible_devices(resource):
        return list(ray.get_runtime_context().get_accelerator_ids().get(resource, []))
    # The same lookup Ray's get_accelerator_ids() does for its accelerators, for a custom resource.
    worker = ray._private.worker.global_worker
    slots = worker.get_accelerator_ids_for_accelerator_resource(resource, f"^{resource}_group_[0-9A-Za-z]+$")
    slots = sorted(int(i) for i in slots)
    node_visible = os.environ.get(visible_env, "") if visible_env else ""
    listed = [v.strip() for v in node_visible.split(",") if v.strip()]
    if not listed:
        return [str(i) for i in slots]
    if any(i >= len(listed) for i in slots):
        raise RayLaunchError(f"Ray assigned {resource} slots {slots}, but the node's {visible_env}={node_visible!r} "
                             f"lists {len(listed)} devices (declare at most that many {resource})")
    return [listed[i] for i in slots]


def bind_assigned_device(kind: str) -> DeviceBinding:
    """Bind the device Ray assigned to this actor as the local device of ``kind``; set ``HAL_DEVICE``.

    Call it first in an actor's ``__init__``. Sets ``LOCAL_RANK`` to the device's visible index, then calls
    ``hal.set_device``. Raises RayLaunchError outside a Ray worker or when Ray assigned no device.
    """
    ray = require_ray()
    import hal

    if not ray.is_initialized():
        raise RayLaunchError("bind_assigned_device must run inside a Ray actor (ray is not initialized here)")
    kind = kind.strip().lower()
    spec = registry.get_spec(kind)
    context = ray.get_runtime_context()
    node_id, node_ip = context.get_node_id(), ray.util.get_node_ip_address()
    os.environ[ENV_VAR] = kind
    resource = resource_name(kind)
    if resource is None:
        os.environ["LOCAL_RANK"] = "0"
        hal.reset()
        hal.resolve_device(kind)
        return DeviceBinding(kind, None, (), None, None, None, 0, "cpu", node_id, node_ip, os.getpid())
    ids = _assigned_ids(ray, resource, spec.visible_devices_env)
    if not ids:
        raise RayLaunchError(f"this actor holds no {resource!r} (device kind {kind!r}): start it with the "
                             f"options of hal.ray.WorkerPlacement.options(), or with resources={{{resource!r}: 1}}")
    device_id = ids[0]
    env = spec.visible_devices_env
    noset = os.environ.get(f"{NOSET_PREFIX}{env}", "").lower() in ("1", "true") if env else True
    if env is None:
        set_by = None
    elif noset:
        set_by = "noset"
    elif ray_sets_visible_devices(resource):
        set_by = "ray"
    elif spec.visible_devices_read():
        set_by = "noset"  # the kind already read the variable (the sim counted its devices): changing it means nothing
    else:
        os.environ[env] = ",".join(ids)
        set_by = "hal"
    visible = os.environ.get(env) if env else None
    if set_by == "noset" and spec.visible_devices_read():
        visible_list = None  # the kind counts devices 0..n-1 by their node-wide ids
    else:
        visible_list = [v.strip() for v in visible.split(",")] if visible else None
    if visible_list is None:
        if not device_id.isdigit():
            raise RayLaunchError(f"device id {device_id!r} of {resource!r} is not an index and {env} is unset")
        local_index = int(device_id)
    elif device_id in visible_list:
        local_index = visible_list.index(device_id)
    else:
        raise RayLaunchError(f"Ray assigned {resource} {device_id} to this actor, but {env}={visible!r} does not "
                             f"make it visible")
    os.environ["LOCAL_RANK"] = str(local_index)
    hal.reset()
    hal.set_device(kind)
    return DeviceBinding(kind, resource, tuple(ids), env, visible, set_by, local_index, device_id, node_id,
                         node_ip, os.getpid())


def check_distinct_devices(bindings: Sequence[DeviceBinding]) -> None:
    """Raise RayLaunchError if two bindings hold one device of one node (cpu bindings never clash)."""
    seen: dict[tuple[str, str], int] = {}
    for i, b in enumerate(bindings):
        if b.resource is None:
            continue
        key = (b.node_id, b.device_id)
        if key in seen:
            raise RayLaunchError(
                f"workers {seen[key]} and {i} both bound {b.resource} {b.device_id} on node {b.node_ip}: Ray gave "
                f"them one id (a custom resource needs {UNIT_INSTANCE_ENV} to list {b.resource!r} when the node "
                f"starts; see hal.ray.node_environment)")
        seen[key] = i


__all__ = [
    "STRATEGIES", "UNIT_INSTANCE_ENV", "SCHEDULE_AS_ENV", "RayLaunchError", "require_ray", "resource_name",
    "schedule_as", "ray_sets_visible_devices", "node_environment", "resource_request", "actor_resources",
    "WorkerPlacement", "place_workers", "DeviceBinding", "bind_assigned_device", "check_distinct_devices",
]
