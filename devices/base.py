"""The data every device kind carries, and the result type of its availability probe.

A device kind is one frozen dataclass: plain facts as fields (after vLLM's ``Platform`` class attributes)
plus two probes, :meth:`DeviceSpec.torch_module` and :meth:`DeviceSpec.availability`. Nothing here imports
a vendor package; each kind's module does that lazily, inside its probes.
"""

from __future__ import annotations

import dataclasses
import types


SIMULATION_MARKER = "__hal_sim__"
"""The attribute (true) of a module that stands in for a vendor package on a simulated kind (the simulated
npu's ``torch_npu``): how a real kind's spec tells the simulation from its hardware without importing it."""


def is_simulation(module: object) -> bool:
    """Whether ``module`` (e.g. an imported vendor package) is a simulation's stand-in (:data:`SIMULATION_MARKER`)."""
    return module is not None and bool(getattr(module, SIMULATION_MARKER, False))


@dataclasses.dataclass(frozen=True)
class Availability:
    """Outcome of a device kind's probe: ``ok`` or the ``reason`` it is not usable.

    Truthy when available, so ``if spec.availability(): ...`` reads naturally.
    """

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
        """This result narrowed to device ``device`` of ``kind`` (``None``: unchanged): unavailable, naming
        the index and the valid range, when the kind is available but the index is outside
        ``[0, device_count)``."""
        if device is None or not self.ok:
            return self
        if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < self.device_count:
            return Availability.unavailable(f"{kind}: device index {device!r} is out of range, this process sees "
                                            f"{self.device_count} device(s) (valid: 0..{self.device_count - 1})")
        return self


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One device kind, immutable.

    Fields:
        kind: the name users select it by (``HAL_DEVICE``, ``--device``); usually equal to ``name``,
            but the simulated Ascend kind is selected as ``"npu-sim"`` and creates ``"npu"`` tensors.
        name: the ``torch.device`` type of its tensors (``"cuda"``, ``"npu"``, ``"cpu"``).
        dist_backend: the ``torch.distributed`` backend for tensors of this kind (``"nccl"``, ``"hccl"``,
            ``"gloo"``), as in ``torch.distributed.Backend.default_device_backend_map``.
        visible_devices_env: the environment variable that restricts which devices a process sees
            (``CUDA_VISIBLE_DEVICES``, ``ASCEND_RT_VISIBLE_DEVICES``), ``None`` where there is none.
        visible_devices_fixed: ``True`` when the kind reads :attr:`visible_devices_env` once, when it is set
            up in a process (CUDA at its first initialisation, the simulated npu when registered), so that
            changing the variable afterwards changes nothing; :meth:`is_set_up` says whether that happened.
        ray_resource: the custom resource name Ray schedules this kind by (``"GPU"``, ``"NPU"``), or ``None``.
        auto_probe: whether automatic resolution may pick this kind (a simulated kind must be asked for).
        host_memory: ``True`` when tensors of this kind live in ordinary host memory (the cpu kind), so that
            offloading to the host moves nothing.
        supports_pin_memory: whether host memory can be page-locked for copies to and from this kind's
            devices (``torch.empty(..., pin_memory=True)``); ``False`` for host-memory kinds, where nothing
            is copied, and by default (unpinned host buffers work everywhere).
        vendor_package: the distribution that backs the kind (``"torch-npu"``), whose version ``hal info``
            reports; ``None`` when torch itself provides it.
        nixl_memory_type: the NIXL memory type this kind's tensors register as (``"DRAM"`` host memory,
            ``"VRAM"`` GPU memory; see NIXL's ``nixl_agent.register_memory``); ``None`` when NIXL cannot
            register them, so a transfer stages them through host memory (``"DRAM"``).
        mooncake_protocol: the Mooncake Transfer Engine protocol that moves this kind's tensors in place
            (``"tcp"`` host memory, ``"rdma"`` GPU memory, ``"ascend_direct"`` Ascend device memory; see
            ``TransferEngine.initialize``); ``None``: stage through host memory over ``"tcp"``.
        fused_adamw: whether torch's fused AdamW (``torch.optim.AdamW(..., fused=True)``: one pass over the
            states, no step temporaries) runs on this kind as hal has checked it; ``False`` by default (the
            foreach implementation, torch's default, keeps about one fp32 copy of the parameters while it steps).

    Subclasses override :meth:`torch_module` and :meth:`availability`, :meth:`create_backend` where
    torch builds the kind's communicator itself (gloo, NCCL) rather than through a registered backend plugin, and
    :meth:`is_set_up` where :attr:`visible_devices_fixed` is ``True``.
    """

    kind: str
    name: str
    dist_backend: str
    visible_devices_env: str | None = None
    visible_devices_fixed: bool = False
    ray_resource: str | None = None
    auto_probe: bool = True
    host_memory: bool = False
    supports_pin_memory: bool = False
    vendor_package: str | None = None
    nixl_memory_type: str | None = None
    mooncake_protocol: str | None = None
    fused_adamw: bool = False
    device_memory_in_host: bool = False
    """The kind's device allocations live in this process's host memory (a simulated device): a host peak
    then counts device bytes too, and what the device's caching allocator keeps (:meth:`host_cached_bytes`)."""

    def torch_module(self) -> types.ModuleType:
        """The torch module with this kind's runtime calls (``torch.cuda``, ``torch.npu``, ...).

        Raises:
            NotImplementedError: the kind did not define one.
            ImportError: the vendor package backing it cannot be imported.
        """
        raise NotImplementedError(f"device kind {self.kind!r} needs a torch_module() probe")

    def availability(self, device: int | None = None) -> Availability:
        """Whether this kind (``device=None``), or its device of index ``device``, can be used in this
        process; never raises (failures, and an index outside ``[0, device_count)``, become the reason).

        Every kind takes this one signature; :meth:`Availability.of_index` narrows a kind's result to one
        device.
        """
        raise NotImplementedError(f"device kind {self.kind!r} needs an availability() probe")

    def ipc_transport(self) -> str:
        """How this kind shares a bucket with another process of the same host (:mod:`devices.ipc`): ``"device"``
        (a device buffer exported as an IPC handle, opened in place) or ``"shm"`` (a shared host segment, copied
        to the receiver's device). ``"shm"`` here; a kind whose runtime exports device memory says so. Never raises.
        """
        return "shm"

    def share_device_buffer(self, nbytes: int, device):
        """A flat ``uint8`` buffer of ``nbytes`` on ``device`` (a ``torch.device`` of this kind) that another
        process opens from its handle (:class:`devices.ipc.SharedDeviceBuffer`); only where :meth:`ipc_transport`
        is ``"device"``.

        Raises:
            NotImplementedError: the kind cannot export device memory (its transport is ``"shm"``).
        """
        raise NotImplementedError(f"device kind {self.kind!r} shares buckets through shared memory, not device IPC")

    def drop_shared_pages(self, mapping, start: int, nbytes: int) -> bool:
        """After reading ``mapping[start:start + nbytes]`` of a buffer another process shares (a segment mapped
        here, or a device buffer opened from its handle), stop counting its pages in this process's resident
        memory; returns whether pages were dropped. A host mapping's pages are dropped
        (:func:`devices.shared_memory.drop_mapped_pages`); device memory is not host memory, so nothing happens
        for it here (a kind whose device memory is host memory overrides this).

        Raises:
            ValueError: the range is not within ``mapping``, or a host ``mapping`` is not a whole mapped segment.
        """
        if mapping.device.type != "cpu":
            return False
        from devices.shared_memory import drop_mapped_pages

        return drop_mapped_pages(mapping, start, nbytes)

    def host_cached_bytes(self) -> int:
        """Bytes of freed blocks the kind's caching allocator may keep resident in host memory, per device, at
        most (0 unless :attr:`device_memory_in_host`): what a memory bound adds for that cache."""
        return 0

    def host_cache_resident_bytes(self, index: int) -> int:
        """Host bytes the freed blocks of device ``index``'s caching allocator hold resident now (0 unless
        :attr:`device_memory_in_host`): on a real device that cache is device memory, not the host's."""
        return 0

    def is_set_up(self) -> bool:
        """Whether this process has already set the kind up (read its visible-devices variable); ``False``
        by default. Only meaningful where :attr:`visible_devices_fixed` is ``True``; never raises."""
        return False

    def visible_devices_read(self) -> bool:
        """Whether changing :attr:`visible_devices_env` in this process can no longer change which devices
        it sees: the kind reads it once (:attr:`visible_devices_fixed`) and has done so (:meth:`is_set_up`)."""
        return self.visible_devices_fixed and self.is_set_up()

    def create_backend(self, store, rank: int, world_size: int, timeout):
        """A c10d backend object for a standalone group of ``world_size`` ranks over ``store``: by default the
        plugin registered under :attr:`dist_backend` with ``torch.distributed.Backend.register_backend`` (HCCL,
        which the vendor module registers when :meth:`torch_module` imports it), or gloo's where that is the
        kind's backend (a plugin kind may name it).

        Args:
            store: a ``torch.distributed.Store`` (prefixed per group); timeout: a ``datetime.timedelta``
                bounding the rendezvous and every collective.

        Raises:
            RuntimeError: no backend is registered under :attr:`dist_backend`.
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
    """Run ``probe`` (returning :class:`Availability`) and turn any exception into an unavailable reason.

    Vendor stacks fail in many ways when the driver or toolkit is missing (``ImportError``,
    ``RuntimeError`` from a driver call, ``OSError`` from a missing shared library), so every one of them is
    caught here and reported as text rather than crashing resolution.
    """
    try:
        return probe()
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return Availability.unavailable(f"{spec_kind} probe raised {type(exc).__name__}: {exc}")
