"""Trainer and rollout workers as Ray actors, placed by the device kind's Ray resource.

Ray's terms (https://docs.ray.io/en/latest/ray-core/scheduling/placement-group.html): a *resource* is a
named quantity a node offers (``CPU``, ``GPU``, ``NPU`` or any custom name); a *bundle* is the resources of
one worker; a *placement group* reserves bundles on the cluster's nodes, packed onto as few nodes as
possible (``PACK``, ``STRICT_PACK``) or spread across them (``SPREAD``, ``STRICT_SPREAD``); an actor then
runs in one bundle.

* :func:`resource_request` - what one worker of a device kind asks Ray for: the kind's ``ray_resource``
  (``GPU`` for cuda, ``NPU`` for Ascend, the simulated npu's own ``NPU_SIM``) plus CPUs.
* :func:`place_workers` - one placement group with a trainer bundle and one bundle per rollout.
* :func:`bind_assigned_device` - first thing inside an actor: the device Ray assigned becomes the local
  device of the kind, and ``HAL_DEVICE`` is set. Ray itself sets ``CUDA_VISIBLE_DEVICES`` /
  ``ASCEND_RT_VISIBLE_DEVICES`` for the accelerators it knows (``GPU``, ``NPU``) unless
  ``RAY_EXPERIMENTAL_NOSET_<VARIABLE>`` is set; for a resource Ray does not know (the simulated npu's) hal
  does the same, under the same switch.
* :class:`LocalCluster` - a Ray node started as a child process with its own ports, temporary directory
  and authentication token, stopped by its process id (never ``ray stop``, which ends every Ray process
  of the machine).

``import hal`` does not import this module, and this module imports ``ray`` only inside its functions:
Ray is an optional extra (``pip install 'hal-posttrain[ray]'``).

Ray assigns device ids per node only to resources it tracks per instance: its accelerators, and the
names listed in ``RAY_custom_unit_instance_resources`` when the node starts. :func:`node_environment`
gives the variables a node of the simulated npu must be started with; :class:`LocalCluster` sets them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any, Literal, Mapping, Sequence

from hal import registry
from hal.device import ENV_VAR
from hal.errors import HalError

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
"""Ray's placement strategies: pack bundles onto few nodes, or spread them (``STRICT_*``: or fail)."""
Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]

UNIT_INSTANCE_ENV = "RAY_custom_unit_instance_resources"
"""Ray's setting listing the custom resources it assigns per-instance ids for (read when a node starts)."""
RAY_UNIT_INSTANCE_DEFAULT = ("neuron_cores", "TPU", "NPU", "HPU", "RBLN", "FURIOSA", "TTNPU", "MBLT")
"""Ray 2.60's default value of that setting (every entry must stay when one is added)."""
NOSET_PREFIX = "RAY_EXPERIMENTAL_NOSET_"
"""``RAY_EXPERIMENTAL_NOSET_<VISIBLE_DEVICES_VARIABLE>=1``: Ray (and hal) leave that variable alone."""
SCHEDULE_AS_ENV = "HAL_RAY_SCHEDULE_AS"
"""``kind=RESOURCE[,kind=RESOURCE]``: on this node (and driver), schedule ``kind`` by ``RESOURCE`` instead of its
spec's ``ray_resource`` (e.g. ``npu-sim=NPU``: the simulated npu stands in for Ascend NPUs; see
:func:`node_environment`)."""
DEFAULT_OBJECT_STORE_BYTES = 256 << 20
"""Object store of a :class:`LocalCluster` node (bytes): weights go through the checkpoint engine, not Ray."""


class RayLaunchError(HalError, RuntimeError):
    """Ray could not place, start or bind a worker (the message names the kind, resource and bundle)."""


def require_ray():
    """The ``ray`` module.

    Raises:
        ImportError: ray is not installed (the message names the extra that installs it).
    """
    try:
        import ray
    except ImportError as exc:
        raise ImportError(f"the Ray launcher needs ray (pip install 'hal-posttrain[ray]'): {exc}") from None
    return ray


def resource_name(kind: str) -> str | None:
    """The Ray resource a device of ``kind`` is scheduled by (``GPU``, ``NPU``, ``NPU_SIM``); ``None`` for cpu.

    Reads the spec only (no probe), so a driver without the device can place workers on nodes that have it.

    Raises:
        UnknownDeviceError: ``kind`` is not a known kind.
    """
    spec = registry.get_spec(kind.partition(":")[0].strip().lower())
    if spec.host_memory:
        return None
    return schedule_as().get(spec.kind, spec.ray_resource)


def schedule_as(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The kinds this process schedules by another Ray resource than their spec's (``HAL_RAY_SCHEDULE_AS``).

    Raises:
        ValueError: an entry is not ``kind=RESOURCE``.
    """
    raw = (os.environ if environ is None else environ).get(SCHEDULE_AS_ENV, "")
    out = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        kind, sep, resource = item.partition("=")
        if not sep or not kind.strip() or not resource.strip():
            raise ValueError(f"{SCHEDULE_AS_ENV}: entry {item!r} is not 'kind=RESOURCE'")
        out[kind.strip().lower()] = resource.strip()
    return out


def ray_sets_visible_devices(resource: str) -> bool:
    """Whether Ray itself sets the visible-devices variable for actors holding ``resource``.

    True for the accelerators Ray ships a manager for (``GPU``, ``NPU``, ...), false for custom resources.
    """
    from ray._private.accelerators import get_all_accelerator_resource_names  # Ray's own list of them

    return resource in set(get_all_accelerator_resource_names())


def node_environment(kinds: Sequence[str] = (), schedule_as: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment a Ray node needs so that each of ``kinds`` gets per-device ids.

    Ray numbers the instances of its own accelerators; a custom resource (the simulated npu's
    ``NPU_SIM``) gets ids only when listed in ``RAY_custom_unit_instance_resources`` at ``ray start``.

    Args:
        schedule_as: kinds to schedule by another resource, e.g. ``{"npu-sim": "NPU"}``: a node declaring
            ``NPU`` then runs the simulated npu where Ray (and verl's own worker groups, which ask for
            ``NPU``) place Ascend workers. Ray sets each such actor's ``ASCEND_RT_VISIBLE_DEVICES`` to the ids
            it assigned, and ``HAL_DEVICE=<kind>`` (set node-wide for a single such kind) registers the sim
            inside the worker's ``import torch``, over exactly those devices; :func:`bind_assigned_device`
            binds by that resource too. The driver needs the same ``HAL_RAY_SCHEDULE_AS`` to place hal's
            workers (:meth:`LocalCluster.connect` sets it).

    Returns:
        ``{}`` when every kind is one Ray knows and nothing is rescheduled, else the variables:
        ``RAY_custom_unit_instance_resources`` (Ray's default list plus the custom resources),
        ``HAL_RAY_SCHEDULE_AS`` and ``HAL_DEVICE``.

    Raises:
        ValueError: ``schedule_as`` names more than one kind (a node has one ``HAL_DEVICE``).
        UnknownDeviceError: a kind is not known.
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
    """The bundle of one worker on ``kind``: ``{"CPU": cpus, <ray_resource>: devices}`` (cpu: CPUs only).

    Raises:
        ValueError: ``cpus`` is negative or ``devices`` is not a positive integer.
        UnknownDeviceError: ``kind`` is not a known kind.
    """
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
    """``ray.remote`` options asking for ``bundle``: ``num_cpus``, ``num_gpus`` and the other ``resources``.

    Ray takes ``CPU`` and ``GPU`` only as ``num_cpus`` / ``num_gpus``; asking through them is also what makes
    Ray assign a GPU and set ``CUDA_VISIBLE_DEVICES``.
    """
    options: dict[str, Any] = {"num_cpus": bundle.get("CPU", 0)}
    if "GPU" in bundle:
        options["num_gpus"] = bundle["GPU"]
    others = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    if others:
        options["resources"] = others
    return options


@dataclasses.dataclass
class WorkerPlacement:
    """A placement group holding the trainer's bundle (index 0) and one bundle per rollout (1..R).

    Attributes:
        kind: the device kind every bundle asks for.
        bundles: the bundles, trainer first.
        strategy: Ray's strategy (see :data:`STRATEGIES`).
        group: the ``ray.util.placement_group.PlacementGroup``.
    """

    kind: str
    bundles: list[dict[str, float]]
    strategy: str
    group: Any

    @property
    def rollouts(self) -> int:
        return len(self.bundles) - 1

    def options(self, bundle_index: int) -> dict[str, Any]:
        """``ray.remote`` options running an actor in bundle ``bundle_index`` (0: trainer, 1..R: rollouts).

        Raises:
            ValueError: no such bundle.
        """
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not 0 <= bundle_index < len(self.bundles):
            raise ValueError(f"bundle_index must be in [0, {len(self.bundles)}), got {bundle_index}")
        bundle = {k: v for k, v in self.bundles[bundle_index].items() if not k.startswith("node:")}
        return {**actor_resources(bundle),
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    self.group, placement_group_bundle_index=bundle_index)}

    def node_ids(self) -> list[str]:
        """The Ray node id (hex) each bundle was placed on, trainer first."""
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

    Args:
        kind: device kind; each bundle asks for one device of it (:func:`resource_request`).
        rollouts: rollout bundles (>= 1).
        strategy: ``PACK`` (few nodes), ``SPREAD`` (many nodes), or their ``STRICT_`` forms.
        cpus: CPUs per bundle.
        trainer_node, rollout_node: a node IP the trainer's / every rollout's bundle must be placed on
            (through Ray's ``node:<ip>`` resource); ``None``: anywhere the strategy allows.
        timeout: seconds to wait for the cluster to satisfy the group.

    Raises:
        ValueError: bad count or strategy.
        RayLaunchError: not placed within ``timeout``; the message gives the bundles asked for and what
            the cluster has (a missing resource name is the usual cause).
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

    Attributes:
        kind: the device kind (``HAL_DEVICE`` is set to it).
        resource: its Ray resource (``None`` on cpu).
        ray_ids: the device ids Ray assigned to the actor (node-wide numbering, as strings).
        visible_env: the kind's visible-devices variable (``None`` on cpu).
        visible: that variable's value after binding (``None``: unset).
        set_by: who set it: ``"ray"``, ``"hal"`` (a resource Ray does not know), ``"noset"`` (the
            ``RAY_EXPERIMENTAL_NOSET_`` switch was on: nobody), ``None`` on cpu.
        local_index: the index the actor's device has in this process (``LOCAL_RANK`` is set to it).
        device_id: the node-wide id of the bound device (``"cpu"`` on cpu).
        node_id, node_ip: the Ray node the actor runs on.
        pid: the actor's process id.
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
    """Ids of ``resource`` Ray assigned to this worker (placement-group forms included), as the node names
    its devices: Ray maps its slot numbers through the visible-devices variable the node started with
    (e.g. ``ASCEND_RT_VISIBLE_DEVICES=4,5``: slot 0 is device 4); hal does the same for a custom resource.

    Raises:
        RayLaunchError: a slot number is past the devices the node's variable lists.
    """
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

    Call it first in an actor's ``__init__``, before anything resolves the device. The steps:

    1. the ids Ray assigned for the kind's resource (exactly one is expected per worker; the first is used);
    2. the visible-devices variable: Ray set it to those ids for its accelerators; for a custom resource hal
       sets it the same way; with ``RAY_EXPERIMENTAL_NOSET_<VARIABLE>=1`` nobody does;
    3. the local index: the bound id's position in the visible list, or the id itself when the variable is
       unset (or the kind had already read it: :meth:`DeviceSpec.visible_devices_read`, the simulated npu
       registered before the binding);
    4. ``HAL_DEVICE=<kind>`` and ``LOCAL_RANK=<local index>``, then ``hal.bind_local_device``.

    Raises:
        RayLaunchError: not inside a Ray worker, or Ray assigned no device of the kind's resource (the
            actor was not started with :meth:`WorkerPlacement.options`), or the bound id is not visible.
        UnknownDeviceError, DeviceUnavailableError: the kind cannot be used in this actor.
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
    hal.bind_local_device(kind)
    return DeviceBinding(kind, resource, tuple(ids), env, visible, set_by, local_index, device_id, node_id,
                         node_ip, os.getpid())


def check_distinct_devices(bindings: Sequence[DeviceBinding]) -> None:
    """Raise unless every binding holds its own device (cpu bindings never clash).

    Raises:
        RayLaunchError: two workers bound one device of one node; names both and the likely cause.
    """
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


# ---- a Ray node as a child process ---------------------------------------------------------------------
# Every port is 0 (and so is the head's --port): each Ray process binds port 0 itself and publishes the port
# it got; Ray 2.60, which the `ray` extra pins, documents `--port=0` as "we will allocate an available port".
# A port picked here and bound later by Ray could be taken in between by any outgoing connection on this
# machine (the kernel hands those out from the same ephemeral range): that failed a CI run with "Address
# already in use". 0 also keeps nodes started side by side (pytest-xdist workers) apart, which Ray's fixed
# default ports would not.
_RAY_PORT_OPTIONS = ("node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
                     "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port")


def _reload_ray_auth() -> None:
    """Make Ray re-read ``RAY_AUTH_MODE`` / ``RAY_AUTH_TOKEN`` (it caches them when first used in a process), and
    its other ``RAY_*`` settings."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


AF_UNIX_PATH_MAX = 107
"""Longest Unix socket path on Linux, in bytes (Ray refuses longer: "AF_UNIX path length cannot exceed 107 bytes")."""
_RAY_SOCKET_SUFFIX = 67
"""Bytes Ray appends to its temporary directory for its longest socket (Ray 2.60): 64 for
``/session_<date>_<time>_<microseconds>_<pid>/sockets/plasma_store`` with a 7-digit process id, plus 3 for the
``.N`` Ray adds to a name in use."""
_SHORT_TEMP_PARENTS = ("/tmp", "/var/tmp", "/dev/shm")
"""Where :func:`ray_temp_parent` looks, in order, when the system's temporary directory is too long for Ray."""
_TEMP_DIR_PREFIX = "hal-ray-"


def ray_temp_parent(base: str | None = None) -> str:
    """The directory :class:`LocalCluster` makes its temporary directory in: ``base`` (default: the system's
    temporary directory, ``$TMPDIR``) when Ray's sockets under it stay within :data:`AF_UNIX_PATH_MAX` bytes,
    else the first of ``/tmp``, ``/var/tmp``, ``/dev/shm`` that is short enough and writable.

    Raises:
        RayLaunchError: none is (names ``base`` and its length, the limit, and what to set).
    """
    base = base if base is not None else tempfile.gettempdir()
    room = AF_UNIX_PATH_MAX - _RAY_SOCKET_SUFFIX - len(_TEMP_DIR_PREFIX) - 8 - 1  # mkdtemp adds 8 characters
    for parent in (base, *_SHORT_TEMP_PARENTS):
        if len(os.fsencode(parent)) <= room and os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK):
            return parent
    raise RayLaunchError(f"Ray's Unix sockets under {base!r} ({len(os.fsencode(base))} bytes) would exceed "
                         f"{AF_UNIX_PATH_MAX} bytes, and none of {', '.join(_SHORT_TEMP_PARENTS)} is a writable "
                         f"directory: set TMPDIR to a directory of at most {room} bytes, or pass LocalCluster(temp_dir=...)")


# ---- connecting to a cluster ---------------------------------------------------------------------------
CONNECT_TIMEOUT_S = 10.0
"""Seconds :func:`connect_cluster` gives a cluster's head to answer, per stage (TCP, then Ray's own client)."""
_RAY_CONNECT_BOUNDS = {
    # Ray 2.60's driver retries its GCS connection 20 times (RAY_NUM_REDIS_GET_RETRIES), each attempt waiting
    # RAY_py_gcs_connect_timeout_s (30 s) after RAY_gcs_rpc_server_connect_timeout_s (5 s): 12 minutes and
    # 60 log lines for an address nothing answers on. One attempt (read by ray._private.node when it connects);
    # the client timeout is filled in with the caller's.
    "RAY_gcs_server_port_wait_time_s": "1",
    "RAY_py_gcs_connect_timeout_s": None,
}


def _tcp_endpoint(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``HOST:PORT`` address (``[v6]:PORT`` too); ``None`` for ``auto``, ``ray://...`` and
    anything else Ray resolves itself."""
    if "://" in address:
        return None
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _unreachable(host: str, port: int, timeout: float) -> str | None:
    """Why a TCP connection to ``host:port`` fails within ``timeout`` seconds; ``None`` when it opens."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except ConnectionRefusedError:
        return "connection refused (nothing listens on that port)"
    except socket.gaierror as exc:
        return f"unknown host {host!r} ({exc.strerror})"
    except TimeoutError:
        return (f"no answer within {timeout:g} s (the host is down or unreachable, or a firewall drops the "
                f"connection)")
    except OSError as exc:
        return exc.strerror or str(exc)


class _CapturedStderr:
    """File descriptor 2 sent to an unnamed temporary file for a ``with`` block: what Ray's C++ core and its
    Python loggers print while a connection is tried, in :attr:`text` after the block."""

    text = ""

    def __enter__(self) -> _CapturedStderr:
        sys.stderr.flush()
        self._file = tempfile.TemporaryFile()
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        return self

    def __exit__(self, *exc: Any) -> None:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        with self._file:
            self._file.seek(0)
            self.text = self._file.read().decode(errors="replace")


def connect_cluster(address: str, timeout: float = CONNECT_TIMEOUT_S, **init_kwargs: Any) -> Any:
    """``ray.init`` this driver to the running cluster at ``address``, in bounded time, failing in one sentence.

    Args:
        address: ``HOST:PORT`` of the cluster's head (its GCS port), ``auto`` (the cluster this node runs) or
            a ``ray://`` client address.
        timeout: seconds (> 0) the head has to answer, per stage: a ``HOST:PORT`` is first opened as a plain
            TCP connection (no Ray logs, a refused port fails at once), then Ray connects with one attempt of
            its client, waiting at most ``timeout`` seconds (about ``timeout + 10`` s in all: Ray's own connect
            and subscribe waits, 5 s each, come first). ``RAY_gcs_server_port_wait_time_s`` and
            ``RAY_py_gcs_connect_timeout_s`` set by the user win.
        init_kwargs: more ``ray.init`` arguments (``log_to_driver=False``, ...).

    What Ray prints while it connects (its C++ core logs each failed try to stderr) is held back: replayed
    when the connection succeeds, dropped when it fails.

    Returns:
        Ray's context.

    Raises:
        ValueError: ``timeout`` is not positive.
        ImportError: ray is not installed.
        RayLaunchError: the head does not answer or Ray refuses the connection; the message names the address,
            why, and what to check.
    """
    import math

    if not timeout > 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout}")
    ray = require_ray()
    check = ("check that the cluster's head runs there ('ray start --head' on it; 'ray status' there prints the "
             "address to pass) and that this machine can reach it")
    endpoint = _tcp_endpoint(address)
    if endpoint is not None:
        reason = _unreachable(*endpoint, timeout)
        if reason is not None:
            raise RayLaunchError(f"cannot reach the Ray cluster at {address}: {reason}; {check}")
    bounds = {k: v if v is not None else str(math.ceil(timeout)) for k, v in _RAY_CONNECT_BOUNDS.items()
              if k not in os.environ}
    os.environ.update(bounds)
    try:
        _reload_ray_auth()  # Ray reads its RAY_* settings when told to
        with _CapturedStderr() as said:
            try:
                context = ray.init(address=address, **init_kwargs)
            except Exception as exc:  # noqa: BLE001 - ConnectionError, RuntimeError, ValueError: all one sentence
                lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
                reason = lines[0].rstrip(".") if lines else "no reason given"
                raise RayLaunchError(f"cannot connect to the Ray cluster at {address}: {type(exc).__name__}: "
                                     f"{reason}; {check}") from None
    finally:
        for key in bounds:
            os.environ.pop(key, None)
    sys.stderr.write(said.text)
    return context


@dataclasses.dataclass
class LocalCluster:
    """A Ray node run by ``ray start --block`` as a child process of this one, stopped by its process id.

    Every port is one its process got by binding port 0 (none of Ray's defaults), the temporary directory is
    its own, the dashboard is off, the object store small, and token authentication is on with a token made
    for this cluster (passed through ``RAY_AUTH_TOKEN``, never written under the home directory).

    Args:
        resources: resources the node declares, e.g. ``{"NPU_SIM": 3}``, ``{"NPU": 8}`` or ``{"GPU": 8}``.
        num_cpus: CPUs the node declares.
        node_ip: the node's address (Ray replaces ``127.0.0.1`` by the host's address).
        head: the head's ``host:port`` to join as a worker node; ``None`` starts a head.
        token: the cluster's token (a worker node must use the head's); default: a new random one.
        object_store_bytes: object store size in bytes.
        temp_dir: Ray's temporary directory, at most 40 bytes long (its sockets go under it); default: a new
            one under the system's, or under ``/tmp`` when that is too long (:func:`ray_temp_parent`), removed
            by :meth:`stop`.
        timeout: seconds :meth:`start` waits for the node to come up.
        node_env: more environment of the node's processes, e.g. ``{"ASCEND_RT_VISIBLE_DEVICES": "4,5"}``
            (which devices of the host the node's ``NPU`` / ``NPU_SIM`` are).
        schedule_as: a kind the node runs under another resource, e.g. ``{"npu-sim": "NPU"}`` with
            ``resources={"NPU": 2}``: verl's own worker groups (which ask Ray for ``NPU``) then place their
            workers on the simulated npu (see :func:`node_environment`).

    Use :meth:`start`, then :meth:`connect` (the driver), and :meth:`stop`; or as a context manager.
    """

    resources: dict[str, float] = dataclasses.field(default_factory=dict)
    num_cpus: int = 2
    node_ip: str = "127.0.0.1"
    head: str | None = None
    token: str | None = None
    object_store_bytes: int = DEFAULT_OBJECT_STORE_BYTES
    temp_dir: str | None = None
    timeout: float = 60.0
    node_env: dict[str, str] = dataclasses.field(default_factory=dict)
    schedule_as: dict[str, str] = dataclasses.field(default_factory=dict)
    process: subprocess.Popen | None = dataclasses.field(default=None, init=False, repr=False)
    address: str | None = dataclasses.field(default=None, init=False)
    start_seconds: float | None = dataclasses.field(default=None, init=False)
    log_path: str | None = dataclasses.field(default=None, init=False)

    def env(self) -> dict[str, str]:
        """Variables a process needs to talk to this cluster (auth) plus those its node was started with.

        ``HAL_SIM_HOST`` (the node's address) makes each node of a one-machine cluster its own simulated
        host, so the simulated npu's communicator tells ``NPU_SIM 0`` of one node from that of another.
        """
        kinds = [k for k in registry.known_kinds() if resource_name(k) in self.resources]
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token or "", "RAY_USAGE_STATS_ENABLED": "0",
                "HAL_SIM_HOST": self.node_ip, **node_environment(kinds, self.schedule_as)}

    def start(self) -> str:
        """Start the node and wait until it serves (head) or joined (worker); returns the head's address.

        Raises:
            RayLaunchError: ``ray start`` exited or the node did not come up within ``timeout`` (the message
                ends with the tail of its log; the child is stopped first), or ``temp_dir`` is too long for Ray's
                sockets, or none is to be found (:func:`ray_temp_parent`).
        """
        require_ray()
        if self.process is not None:
            raise RayLaunchError(f"this LocalCluster node is already running (pid {self.process.pid})")
        self.token = self.token or uuid.uuid4().hex
        if self.temp_dir is None:  # its Unix sockets must fit in AF_UNIX_PATH_MAX bytes: a long $TMPDIR is passed over
            self.temp_dir = tempfile.mkdtemp(prefix=_TEMP_DIR_PREFIX, dir=ray_temp_parent())
            self._own_temp_dir = True
        elif len(os.fsencode(self.temp_dir)) + _RAY_SOCKET_SUFFIX > AF_UNIX_PATH_MAX:
            raise RayLaunchError(f"temp_dir {self.temp_dir!r} is too long for Ray's Unix sockets (at most "
                                 f"{AF_UNIX_PATH_MAX - _RAY_SOCKET_SUFFIX} bytes, got {len(os.fsencode(self.temp_dir))})")
        cmd = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--block",
               f"--node-ip-address={self.node_ip}", f"--num-cpus={self.num_cpus}",
               f"--num-gpus={int(self.resources.get('GPU', 0))}",
               f"--resources={json.dumps({k: v for k, v in self.resources.items() if k != 'GPU'})}",
               f"--object-store-memory={self.object_store_bytes}",
               f"--temp-dir={self.temp_dir}", "--min-worker-port=0", "--max-worker-port=0",
               "--disable-usage-stats", "--include-log-monitor=false",
               *[f"--{name}=0" for name in _RAY_PORT_OPTIONS]]
        if self.head is None:
            cmd += ["--head", "--port=0", "--include-dashboard=false"]
        else:
            cmd += [f"--address={self.head}"]
        self.log_path = os.path.join(self.temp_dir, "ray-start.log")
        # HAL_DEVICE is the binding's to set, per actor: a node-wide one would activate the simulated npu
        # inside `import torch` of every worker, before hal could give it its own visible device
        env = {**{k: v for k, v in os.environ.items() if k != ENV_VAR}, **self.node_env, **self.env()}
        begin = time.perf_counter()
        with open(self.log_path, "ab") as log:
            # its own session: every Ray process it starts shares it, so stop() can find them by id
            self.process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_up()
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.perf_counter() - begin
        return self.address

    def _log_tail(self, chars: int = 3000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-chars:]
        except OSError as exc:
            return f"(no log: {exc})"

    def _wait_up(self) -> None:
        deadline = time.monotonic() + self.timeout
        pattern = re.compile(r"ray start --address='([^']+)'")
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RayLaunchError(f"ray start exited with status {self.process.returncode}:\n{self._log_tail()}")
            text = self._log_tail(200_000)
            if self.head is None:
                match = pattern.search(text)
                if match and "--block" in text:
                    self.address = match.group(1)
                    return
            elif "Ray runtime started" in text and "--block" in text:
                self.address = self.head
                return
            time.sleep(0.1)
        raise RayLaunchError(f"the Ray node at {self.node_ip} did not come up within {self.timeout:g} s:\n"
                             f"{self._log_tail()}")

    def connect(self, **init_kwargs: Any):
        """``ray.init`` this driver to the cluster (with its token, and the node's ``HAL_RAY_SCHEDULE_AS`` so that
        hal places workers by the resource the node declares); returns Ray's context."""
        ray = require_ray()
        os.environ.update({k: v for k, v in self.env().items() if k.startswith("RAY_AUTH") or k == SCHEDULE_AS_ENV})
        _reload_ray_auth()
        return ray.init(address=self.address, log_to_driver=init_kwargs.pop("log_to_driver", False),
                        **init_kwargs)

    def pids(self) -> list[int]:
        """Process ids of this node's processes still alive (its ``ray start`` and what that started)."""
        if self.process is None:
            return []
        sid, found = self.process.pid, []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":  # session id is field 6 of stat (index 3 after the name)
                found.append(int(entry))
        return found

    def stop(self, timeout: float = 30.0) -> None:
        """Stop this node: SIGTERM to its ``ray start`` (Ray drains and ends its processes), then SIGKILL to
        any of its processes left after ``timeout`` seconds. Ends only processes of this node, by id."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 5.0
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.process = None
        if getattr(self, "_own_temp_dir", False):  # made by start(): logs and sockets go with the node
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir, self._own_temp_dir = None, False

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = [
    "STRATEGIES", "UNIT_INSTANCE_ENV", "SCHEDULE_AS_ENV", "RayLaunchError", "require_ray", "resource_name",
    "schedule_as", "ray_sets_visible_devices",
    "node_environment", "resource_request", "actor_resources", "WorkerPlacement", "place_workers",
    "DeviceBinding", "bind_assigned_device", "check_distinct_devices", "LocalCluster", "CONNECT_TIMEOUT_S",
    "connect_cluster", "AF_UNIX_PATH_MAX", "ray_temp_parent",
]
