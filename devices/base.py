"""The data every device kind carries, and the result type of its availability probe.

A device kind is one frozen dataclass of facts plus two probes, :meth:`DeviceSpec.torch_module` and
:meth:`DeviceSpec.availability`; vendor packages are imported lazily, inside the probes.
"""

from __future__ import annotations

import dataclasses
import types


# The attribute (true) of a module standing in for a vendor package on a simulated kind (npu-sim's torch_npu).
SIMULATION_MARKER = "__hal_sim__"


def is_simulation(module: object) -> bool:
    """Return whether ``module`` is a simulation's stand-in for a vendor package (:data:`SIMULATION_MARKER`)."""
    return module is not None and bool(getattr(module, SIMULATION_MARKER, False))


@dataclasses.dataclass(frozen=True)
class Availability:
    """Outcome of a device kind's probe: ``ok`` or the ``reason`` it is not usable; truthy when available."""

    ok: bool
    reason: str = ""
    device_count: int = 0

    def __bool__(self) -> bool:
        return self.ok

    @classmethod
    def available(cls, device_count: int = 1) -> Availability:
        return cls(True, "", device_count)

    @classmethod
    def unavailable(cls, reason: str) -> Availability:
        return cls(False, reason, 0)

    def of_index(self, kind: str, device: int | None) -> Availability:
        """Narrow this result to device ``device`` of ``kind``: unavailable if outside ``[0, device_count)``."""
        if device is None or not self.ok:
            return self
        if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < self.device_count:
            return Availability.unavailable(f"{kind}: device index {device!r} is out of range, this process sees "
                                            f"{self.device_count} device(s) (valid: 0..{self.device_count - 1})")
        return self


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One device kind, immutable.

    Subclasses override :meth:`torch_module` and :meth:`availability`, :meth:`create_backend` where torch builds
    the communicator itself (gloo, NCCL), and :meth:`is_set_up` where :attr:`visible_devices_fixed` is ``True``.
    """

    kind: str  # the name users select it by (HAL_DEVICE); npu-sim creates "npu" tensors
    name: str  # the torch.device type of its tensors ("cuda", "npu", "cpu")
    dist_backend: str  # the torch.distributed backend ("nccl", "hccl", "gloo")
    visible_devices_env: str | None = None  # CUDA_VISIBLE_DEVICES, ASCEND_RT_VISIBLE_DEVICES
    visible_devices_fixed: bool = False  # read once, when the kind is set up in a process (see is_set_up)
    ray_resource: str | None = None  # the resource Ray schedules it by ("GPU", "NPU")
    auto_probe: bool = True  # automatic resolution may pick it (a simulated kind must be asked for)
    host_memory: bool = False  # tensors live in ordinary host memory: offloading moves nothing
    supports_pin_memory: bool = False  # host memory can be page-locked for copies to and from it
    vendor_package: str | None = None  # the distribution backing it ("torch-npu"), for hal info
    nixl_memory_type: str | None = None  # "DRAM" / "VRAM"; None: NIXL stages through host memory
    mooncake_protocol: str | None = None  # "tcp", "rdma", "ascend_direct"; None: stage through host over tcp
    fused_adamw: bool = False  # torch's fused AdamW was checked on this kind (else foreach, one fp32 copy more)
    device_memory_in_host: bool = False  # device allocations live in host memory (a simulated device)

    def torch_module(self) -> types.ModuleType:
        """Return the torch module with this kind's runtime calls (``torch.cuda``, ``torch.npu``, ...)."""
        raise NotImplementedError(f"device kind {self.kind!r} needs a torch_module() probe")

    def availability(self, device: int | None = None) -> Availability:
        """Return whether this kind, or its device ``device``, can be used in this process; never raises."""
        raise NotImplementedError(f"device kind {self.kind!r} needs an availability() probe")

    def ipc_transport(self) -> str:
        """Return how this kind shares a bucket with another process of the same host: ``"device"`` or ``"shm"``.

        ``"device"``: a device buffer exported as an IPC handle; ``"shm"`` (the default): a shared host segment.
        """
        return "shm"

    def share_device_buffer(self, nbytes: int, device):
        """Return a flat ``uint8`` buffer of ``nbytes`` on ``device`` that another process opens from its handle.

        Only where :meth:`ipc_transport` is ``"device"``; NotImplementedError otherwise.
        """
        raise NotImplementedError(f"device kind {self.kind!r} shares buckets through shared memory, not device IPC")

    def drop_shared_pages(self, mapping, start: int, nbytes: int) -> bool:
        """Stop counting the pages of ``mapping[start:start + nbytes]`` (shared by another process) as resident here.

        Returns whether pages were dropped: a host mapping's are (ValueError for a range outside a whole mapped
        segment); device memory is not host memory, so nothing happens for it.
        """
        if mapping.device.type != "cpu":
            return False
        from devices.shared_memory import drop_mapped_pages

        return drop_mapped_pages(mapping, start, nbytes)

    def host_cached_bytes(self) -> int:
        """Return the most bytes of freed blocks the kind's caching allocator keeps in host memory, per device."""
        return 0

    def host_cache_resident_bytes(self, index: int) -> int:
        """Return the host bytes the freed blocks of device ``index``'s caching allocator hold resident now."""
        return 0

    def is_set_up(self) -> bool:
        """Return whether this process has already set the kind up (read its visible-devices variable)."""
        return False

    def visible_devices_read(self) -> bool:
        """Return whether changing :attr:`visible_devices_env` can no longer change which devices this process sees."""
        return self.visible_devices_fixed and self.is_set_up()

    def create_backend(self, store, rank: int, world_size: int, timeout):
        """Return a c10d backend for a standalone group of ``world_size`` ranks over ``store``.

        By default the plugin registered under :attr:`dist_backend` (RuntimeError if none), or gloo's.
        ``timeout`` is a ``datetime.timedelta`` bounding the rendezvous and every collective.
        """
        import torch.distributed as dist

        from devices import torch_compat

        if self.dist_backend == dist.Backend.GLOO:
            return dist.ProcessGroupGloo(store, rank, world_size, timeout)
        self.torch_module()  # importing the vendor module registers its backend plugin
        plugin = torch_compat.backend_plugin(self.dist_backend)
        if plugin is None:
            raise RuntimeError(f"collective backend {self.dist_backend!r} of device kind {self.kind!r} is not "
                               f"registered with torch.distributed (registered plugins: "
                               f"{torch_compat.registered_backend_plugins()})")
        if not plugin.extended_api:
            return plugin.creator_fn(store, rank, world_size, timeout)
        return plugin.creator_fn(torch_compat.extended_backend_options(store, rank, world_size, timeout, "hal"), None)


def probe_safely(spec_kind: str, probe) -> Availability:
    """Run ``probe`` and turn any exception (vendor stacks fail in many ways) into an unavailable reason."""
    try:
        return probe()
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return Availability.unavailable(f"{spec_kind} probe raised {type(exc).__name__}: {exc}")
