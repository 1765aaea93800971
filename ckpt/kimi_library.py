"""hal's adapter around Kimi's ``checkpoint-engine`` 0.4.2 library (``checkpoint_engine.ps.ParameterServer``).

Every piece of hal that touches the library's internals:

* :class:`ParameterServerAdapter`: one ``ParameterServer`` built without its constructor's rendezvous and
  ``npu-smi`` call, from subclasses of the library's ``DeviceManager`` (facts from the hal device spec),
  ``P2PStore`` (Mooncake, rank given) and ``ParameterServer``; its methods are the library calls the engine makes.
* :func:`mooncake_protocol`: the kind's ``mooncake_protocol``, else host memory over ``tcp`` copied to the device.
* The library's collectives use torch's default group; :func:`install_backend` puts hal's ``Distributed``
  backend into ``checkpoint_engine.distributed.base._BACKEND_INSTANCE``, answering ``all_gather_object`` for
  calls made inside a hal engine over its control channel (:class:`World`), and passing every other call on.
* The library's loguru INFO records are dropped while hal's engine calls it (:func:`quiet_library_logs`);
  ``HAL_KIMI_LOGS=1`` lets them through.

The private functions used were checked against 0.4.2 only: other versions are unavailable."""

from __future__ import annotations

import contextlib
import contextvars
import os
import pickle
from typing import Any, Iterator

import torch

import hal
from ckpt.control import ControlChannel, PeerFailure
from ckpt.errors import CheckpointConfigError, TransferError, TransferTimeoutError

# checkpoint-engine versions whose private functions and attributes this adapter was checked against.
CHECKED_VERSIONS = ("0.4.2",)
HOST_PROTOCOL = "tcp"  # Mooncake's protocol for host memory, where the kind has no mooncake_protocol.
# Set to 1 to let checkpoint-engine's INFO (and lower) records through while hal's engine calls it.
LOGS_ENV = "HAL_KIMI_LOGS"
_LOGGING_MODULES = ("ps", "p2p_store", "pin_memory", "device_utils")  # the library's modules hal calls into


def library_problem() -> str:
    """Return why checkpoint-engine cannot be used by this adapter, or ``""``."""
    try:
        import checkpoint_engine
        import checkpoint_engine.ps
    except Exception as exc:  # noqa: BLE001 - ImportError of it or its dependencies
        return (f"import checkpoint_engine.ps failed ({type(exc).__name__}: {exc}); install the 'kimi' extra "
                "(pip install --no-deps checkpoint-engine==0.4.2, then its dependencies)")
    version = getattr(checkpoint_engine, "__version__", "unknown")
    if version not in CHECKED_VERSIONS:
        return (f"checkpoint-engine {version} is installed; hal's adapter was checked against "
                f"{', '.join(CHECKED_VERSIONS)} only (pip install --no-deps checkpoint-engine==0.4.2)")
    try:
        import mooncake.engine  # noqa: F401 - imported to learn whether the library and libibverbs load
    except Exception as exc:  # noqa: BLE001 - ImportError, OSError (libibverbs.so.1 missing)
        return (f"import mooncake.engine failed ({type(exc).__name__}: {exc}); checkpoint-engine's p2p path "
                "needs Mooncake (the 'mooncake' extra)")
    return ""


# ---- the library's collectives over hal's store ---------------------------------------------------------
class World:
    """One engine's world for the library's collectives, on its control channel; ``calls`` counts collectives."""

    def __init__(self, channel: ControlChannel, world_size: int) -> None:
        self.channel, self.rank, self.world_size = channel, channel.rank, world_size
        self.calls = 0

    def wait(self, keys: dict[int, str], what: str) -> None:
        """Wait for every key of ``keys`` (``{rank: key name}``) until the channel's timeout, naming missing ranks."""
        try:
            self.channel.wait_posted(keys, what)
        except PeerFailure as exc:
            raise (TransferTimeoutError if exc.timed_out else TransferError)(f"{what}: {exc}") from None

    def all_gather_object(self, object_list: list, obj: Any) -> None:
        """Run ``torch.distributed.all_gather_object`` over the store: ``object_list[r]`` becomes rank r's ``obj``."""
        self.calls += 1
        prefix = f"gather/{self.calls}/"
        what = f"checkpoint-engine gather_metas on {self.channel.label(self.rank)}"
        try:
            self.channel.post_bytes(prefix + str(self.rank), pickle.dumps(obj))
        except PeerFailure as exc:
            raise TransferError(f"{what}: {exc}") from None
        self.wait({r: prefix + str(r) for r in range(self.world_size) if r != self.rank}, what)
        for r in range(self.world_size):
            object_list[r] = obj if r == self.rank else pickle.loads(self.channel.get_bytes(prefix + str(r)))


_CURRENT: contextvars.ContextVar[World | None] = contextvars.ContextVar("hal_kimi_world", default=None)
_INSIDE_HAL: contextvars.ContextVar[bool] = contextvars.ContextVar("hal_kimi_call", default=False)


def install_backend() -> None:
    """Install hal's ``Distributed`` backend into checkpoint-engine, once per process."""
    from checkpoint_engine.distributed import base

    if getattr(base._BACKEND_INSTANCE, "hal_routes", False):
        return

    class _HalRoutedDistributed(base.Distributed):
        """Calls made inside a hal engine go to its :class:`World`; others to the backend installed before."""

        hal_routes = True

        def __init__(self, previous: Any) -> None:
            self.previous = previous

        def _world(self, what: str) -> World | None:
            world = _CURRENT.get()
            if world is not None and what not in ("all_gather_object", "is_initialized"):
                raise CheckpointConfigError(f"checkpoint-engine called {what} inside hal's kimi engine, which "
                                            "answers only all_gather_object (checked against 0.4.2)")
            return world

        def init_process_group(self, rank, world_size, store, **kwargs):
            self._world("init_process_group")
            return self.previous.init_process_group(rank, world_size, store, **kwargs)

        def destroy_process_group(self, group=None):
            self._world("destroy_process_group")
            return self.previous.destroy_process_group(group)

        def is_initialized(self) -> bool:
            return True if self._world("is_initialized") is not None else self.previous.is_initialized()

        def all_gather_object(self, object_list, obj, group=None):
            world = self._world("all_gather_object")
            if world is None:
                return self.previous.all_gather_object(object_list, obj, group)
            return world.all_gather_object(object_list, obj)

        def all_reduce(self, tensor, op=torch.distributed.ReduceOp.SUM, group=None, **kwargs):
            self._world("all_reduce")
            return self.previous.all_reduce(tensor, op, group, **kwargs)

        def broadcast(self, tensor, src=0, group=None, **kwargs):
            self._world("broadcast")
            return self.previous.broadcast(tensor, src, group, **kwargs)

        def barrier(self, group=None, **kwargs):
            self._world("barrier")
            return self.previous.barrier(group, **kwargs)

        def new_group(self, ranks, **kwargs):
            self._world("new_group")
            return self.previous.new_group(ranks, **kwargs)

    base._BACKEND_INSTANCE = _HalRoutedDistributed(base._BACKEND_INSTANCE)


# ---- the library's logging, quiet while hal calls it ------------------------------------------------------
def _quiet(level: str):
    def log(self: _QuietInsideHal, message: Any, *args: Any, **kwargs: Any) -> None:
        if _INSIDE_HAL.get() and os.environ.get(LOGS_ENV, "") != "1":
            return None
        return getattr(self.logger.opt(depth=1), level)(message, *args, **kwargs)

    log.__name__ = level
    return log


class _QuietInsideHal:
    """Stands in for loguru's ``logger`` in the library's modules, dropping TRACE..SUCCESS inside hal's engine.

    Other records go to loguru as the library's own (``opt(depth=1)``), so the user's configuration applies."""

    trace, debug, info, success = (_quiet(level) for level in ("trace", "debug", "info", "success"))

    def __init__(self, logger: Any) -> None:
        self.logger = logger

    def __getattr__(self, name: str) -> Any:  # warning, error, exception, opt, catch...: the logger's own
        return getattr(self.logger, name)


def quiet_library_logs() -> None:
    """Make the library's INFO-and-below records of hal's calls droppable (once per process)."""
    import importlib

    from loguru import logger

    for name in _LOGGING_MODULES:
        module = importlib.import_module(f"checkpoint_engine.{name}")
        if getattr(module, "logger", None) is logger:
            module.logger = _QuietInsideHal(logger)


@contextlib.contextmanager
def _hal_call(world: World | None = None) -> Iterator[None]:
    """Mark the library calls made inside as hal's (quiet logs) and, with ``world``, routed to it."""
    inside = _INSIDE_HAL.set(True)
    routed = _CURRENT.set(world) if world is not None else None
    try:
        yield
    finally:
        if routed is not None:
            _CURRENT.reset(routed)
        _INSIDE_HAL.reset(inside)


# ---- the library's objects, built from the hal device kind -----------------------------------------------
def mooncake_protocol(spec) -> tuple[str, bool]:
    """Return ``(protocol, in_place)`` for kind ``spec``: in place when Mooncake moves device memory itself.

    ``rdma`` also needs an RDMA NIC, found as checkpoint-engine finds it; without one, ``tcp`` on host memory."""
    protocol = spec.mooncake_protocol
    if protocol is None:
        return HOST_PROTOCOL, False
    if protocol == "rdma":
        from checkpoint_engine.device_utils import _get_rdma_devices

        try:
            nics = _get_rdma_devices()
        except OSError:  # libibverbs.so.1 missing
            nics = []
        if not nics:
            return HOST_PROTOCOL, False
    return protocol, True


def _make_parameter_server(spec, protocol: str, device_index: int, rank: int, world_size: int, host: str):
    """Build a ``ParameterServer`` whose device manager and Mooncake store come from ``spec`` and ``protocol``."""
    from checkpoint_engine.device_utils import DeviceManager
    from checkpoint_engine.p2p_store import P2PStore
    from checkpoint_engine.ps import ParameterServer
    from mooncake.engine import TransferEngine

    class HalDeviceManager(DeviceManager):

        def __init__(self) -> None:
            self.device_type = spec.name
            self.device_module = hal.get_torch_device(spec)

        @property
        def backend(self) -> str:
            return spec.dist_backend

        @property
        def transfer_engine_protocol(self) -> str:
            return protocol

        def rdma_device(self, rank: int) -> str:
            return super().rdma_device(rank) if self.transfer_engine_protocol == "rdma" else ""

    class HalP2PStore(P2PStore):

        def __init__(self, device_manager: DeviceManager) -> None:
            self.rank, self.ip = rank, host
            self.device = device_manager.rdma_device(device_index)
            self.engine = TransferEngine()
            protocol = device_manager.transfer_engine_protocol
            rc = self.engine.initialize(host, "P2PHANDSHAKE", protocol, self.device)
            if rc != 0:
                raise TransferError(f"Mooncake TransferEngine.initialize({host!r}, 'P2PHANDSHAKE', {protocol!r}, "
                                    f"{self.device!r}) returned {rc} on rank {rank}")
            self.port = self.engine.get_rpc_port()
            self.named_tensors = {}

        def batch_transfer_sync_read(self, target_hostname, buf_ptrs, remote_ptrs, lens) -> None:
            rc = self.engine.batch_transfer_sync_read(target_hostname, buf_ptrs, remote_ptrs, lens)
            if rc != 0:
                raise TransferError(f"Mooncake batch_transfer_sync_read of {sum(lens)} bytes from {target_hostname} "
                                    f"returned {rc} (the peer is dead or unreachable)")

    class HalParameterServer(ParameterServer):
        """``ParameterServer`` state as its 0.4.2 constructor sets it, for the methods hal calls."""

        def __init__(self) -> None:
            from collections import defaultdict

            self._rank, self._world_size = rank, world_size
            self.device_manager = HalDeviceManager()
            self._gpu_count = max(1, self.device_manager.device_module.device_count())
            self._local_rank = device_index
            self._auto_pg = False
            self._all_hosts, self._global_device_uuids = [], []
            self._local_rdma_devices, self._remote_rdma_devices = defaultdict(set), defaultdict(set)
            self._mem_fraction = 0.9
            self._zmq_ctx, self._zmq_addr_counter = None, 0
            self._current_shared_memory_pool_user = ""
            self._memory_pool = {self.shared_memory_pool_name: []}
            self._current_global_parameter_metas = {}
            self._p2p_store = HalP2PStore(self.device_manager)
            # the library reads it from npu-smi / CUDA; only its update() path (device IPC sockets) uses it
            self._device_uuid = f"{spec.kind}-{host}-{os.getpid()}-{device_index}"
            self._rdma_device = self._p2p_store.device
            self._store, self._store_counter = None, 0

    return HalParameterServer()


class ParameterServerAdapter:
    """The library calls hal's kimi engine makes, on one ``ParameterServer`` built from the hal kind.

    One checkpoint and one receiving buffer are registered at a time. Raises :class:`TransferError` when
    Mooncake's transfer engine does not start."""

    CHECKPOINT = "hal-kimi"
    BUFFER = "__hal_receive_buffer__"

    def __init__(self, spec, protocol: str, device_index: int, rank: int, world_size: int, host: str,
                 world: World) -> None:
        quiet_library_logs()
        install_backend()
        self.world = world
        with _hal_call():
            self.ps = _make_parameter_server(spec, protocol, device_index, rank, world_size, host)

    def register(self, named: dict[str, torch.Tensor]) -> None:
        """Copy ``named`` into the library's shared pinned pool (reused while sizes match) and register it."""
        with _hal_call():
            self.ps.register_checkpoint(self.CHECKPOINT, named_tensors=named, use_inplace_pin_memory=False,
                                        use_shared_memory_pool=True)

    def unregister(self, force: bool) -> None:
        """Unregister the checkpoint; ``force`` also frees the shared pinned pool."""
        with _hal_call():
            self.ps.unregister_checkpoint(self.CHECKPOINT, force=force)

    def gather_metas(self) -> dict:
        """Return every rank's buffer layout, ``{owner rank: MemoryBufferMetaList}``, gathered over :attr:`world`."""
        with _hal_call(self.world):
            self.ps.gather_metas(self.CHECKPOINT)
        return self.ps._current_global_parameter_metas

    def buckets(self, metas: dict, size: int, receivers: list[int]) -> list:
        """Cut ``metas`` into buckets of at most ``size`` bytes: ``[(receiver, owner rank, H2DBucket)]``."""
        from checkpoint_engine.ps import _gen_h2d_buckets

        with _hal_call():
            return _gen_h2d_buckets(metas, size, self.ps._local_rdma_devices, self.ps._remote_rdma_devices,
                                    receivers)

    def pull(self, bucket: Any, target: torch.Tensor, owner: int) -> None:
        """Read ``bucket`` from rank ``owner``'s registered host memory into ``target``."""
        with _hal_call():
            self.ps._copy_to_buffer(self.CHECKPOINT, bucket, target, owner)

    @staticmethod
    def items(bucket: Any) -> list[dict]:
        """Return the tensors of ``bucket``: ``{"name", "dtype", "shape", "offset" (bytes)}`` each."""
        from checkpoint_engine.ps import _to_named_tensor

        return _to_named_tensor(bucket.items, 0)

    def register_buffer(self, buffer: torch.Tensor) -> None:
        with _hal_call():
            self.ps._p2p_store.register_named_tensors({self.BUFFER: buffer})

    def unregister_buffer(self) -> None:
        with _hal_call():
            self.ps._p2p_store.unregister_named_tensors([self.BUFFER])


__all__ = ["CHECKED_VERSIONS", "HOST_PROTOCOL", "LOGS_ENV", "World", "ParameterServerAdapter",
           "install_backend", "library_problem", "mooncake_protocol", "quiet_library_logs"]
