"""The soak's part inside a worker: a checkpoint engine that strikes an armed fault at its moment, and a host
around the job's role that arms it and reports what the role published, serves and holds.

:class:`Host` wraps a :class:`hal.apps.weightsync.worker.Worker`; the driver calls ``arm``/``disarm``,
``observe`` (served step and CRC-32 per tensor) and ``resources`` (pid, descriptors, resident bytes). Notices
go to the driver at once: ``("published", step, sums)`` before a step is sent, ``("struck", fault, seconds)``
before a kill or stop takes effect.

:class:`StrikingEngine` fronts the role's engine and strikes at the fault's moment: ``before_send`` at the
entry of ``send_weights``/``receive_weights`` (a full filesystem: at the trainer's ``train``),
``mid_bucket`` once ``fraction`` of the update's bytes went through (of the fewest an update carried, for a
stream of unknown length), ``during_apply`` when the receive stream ended, ``during_finalize`` at
``finalize()``. A flip corrupts a copy of the received tensor.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from typing import Any, AsyncIterator, Callable, Iterable

from ckpt.manager import ManagedWorker, method_class
from hal.apps.soak.faults import Fault
from hal.apps.weightsync.trainer import Trainer

# the file a full_disk / full_shm fault fills its filesystem with (removed by the driver afterwards)
BALLAST = "hal-soak-ballast"
# a slow_link fault's rate, bits/s each way: an update of the tiny preset then outlasts the default timeout
SLOW_RATE_BPS = 2e6
LINK_CMD_TIMEOUT_S = 10.0  # seconds per ip / tc command
# a number of frames: every worker traces its Python allocations and says where they grew most
TRACE_ENV = "HAL_SOAK_TRACEMALLOC"
FLIP_MASK = 0x10  # a high mantissa bit of a bf16 value


@dataclasses.dataclass(frozen=True)
class Surroundings:
    """What a worker's strikes act on besides itself (picklable): the ``network`` and this worker's ``endpoint``
    in it, the directories ``full_disk`` and ``full_shm`` fill (or ``None``)."""

    network: Any = None
    endpoint: str | None = None
    disk_dir: str | None = None
    shm_dir: str | None = None


def fill(directory: str) -> int:
    """Fill the filesystem of ``directory`` with :data:`BALLAST` until ``ENOSPC``; returns the bytes allocated."""
    path = os.path.join(directory, BALLAST)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        stat = os.statvfs(directory)
        free = stat.f_bavail * stat.f_frsize
        allocated = 0
        try:
            if free:
                os.posix_fallocate(fd, 0, free)
                allocated = free
        except OSError:
            pass
        os.lseek(fd, allocated, os.SEEK_SET)
        chunk = b"\0" * 4096
        while True:
            try:
                written = os.write(fd, chunk)
            except OSError:  # ENOSPC: full
                break
            if written <= 0:
                break
            allocated += written
        return allocated
    finally:
        os.close(fd)


def crc32(tensor: Any) -> str:
    """CRC-32 of a tensor's bytes, 8 hex digits (:func:`hal.apps.weightsync.verify.crc32`)."""
    from hal.apps.weightsync.verify import crc32 as tensor_crc32

    return tensor_crc32(tensor)


class Host:
    """The soak's host around ``worker``; ``notify(message)`` sends a notice to the driver at once.
    ``in_process`` (colocated) refuses kills and stops."""

    def __init__(self, worker: Any, notify: Callable[[tuple], None], surroundings: Surroundings | None = None,
                 in_process: bool = False) -> None:
        self.worker, self.notify = worker, notify
        self.surroundings = surroundings or Surroundings()
        self.in_process = in_process
        self.armed: Fault | None = None
        # the last update_weights as the rollout reported it (update, served_step, error, raised, started/ended_at)
        self.reported: dict[str, Any] | None = None
        self.current: int | None = None  # global_steps of the update in progress
        self._first_snapshot: Any = None
        # fewest bytes an update carried so far: a mid_bucket strike's reference on a stream of unknown length
        self.min_bytes = 0

    @property
    def index(self) -> int:
        return self.worker.index

    async def invoke(self, method: Callable, *args: Any, **kwargs: Any) -> Any:
        """A :class:`Host` method runs here; anything else is the worker's, with what the soak records around it."""
        if method in HOST_CALLS:
            return method(self, *args, **kwargs)
        if method_class(method) is Host:
            raise AttributeError(f"the soak host's calls are {[m.__qualname__ for m in HOST_CALLS]}, got "
                                 f"{method.__qualname__}")
        if method is ManagedWorker.update_weights and self.index != 0:
            self.current = args[0] if args else kwargs.get("global_steps")
            started = time.time()
            try:
                result = await self.worker.invoke(method, *args, **kwargs)
            except Exception as exc:
                self.reported = {"update": self.current, "served_step": None, "error": f"{type(exc).__name__}: {exc}",
                                 "raised": True, "started_at": started, "ended_at": time.time()}
                raise
            self.reported = {"update": self.current, "served_step": result.served_step, "error": result.error,
                             "raised": False, "started_at": started, "ended_at": time.time()}
            return result
        if method is ManagedWorker.update_weights:
            self.current = args[0] if args else kwargs.get("global_steps")
        if method is Trainer.train and self.index == 0:
            fault = self.due("before_send", args[0])
            if fault is not None and fault.kind in ("full_disk", "full_shm"):
                self.strike(fault)  # before the trainer stages the update (it may stage into shared memory)
        result = await self.worker.invoke(method, *args, **kwargs)
        if method in (Trainer.train, Trainer.stage) and self.index == 0:
            step = args[0] if method is Trainer.train else 0
            self.notify(("published", step, {name: crc32(t) for name, t in self.worker.published()}))
        return result

    def arm(self, fault: Fault) -> None:
        """Strike ``fault`` at its moment of update ``fault.update``."""
        if fault.target != self.index:
            raise ValueError(f"fault {fault.describe()} targets worker {fault.target}, not this one ({self.index})")
        if self.in_process and fault.kind in ("kill", "stop"):
            raise ValueError(f"a {fault.kind} cannot strike a worker in the driver's own process")
        self.armed = fault

    def disarm(self) -> bool:
        """Drop the armed fault; returns whether one was armed (it never struck)."""
        armed, self.armed = self.armed, None
        return armed is not None

    def observe(self) -> dict[str, Any]:
        """What this worker serves: ``{"served_step", "sums", "reported"}`` for a rollout, ``{}`` for the trainer."""
        if self.index == 0:
            return {}
        adapter = self.worker.adapter
        return {"served_step": adapter.served_step, "degraded": bool(getattr(adapter, "degraded", None)),
                "sums": {name: crc32(t) for name, t in adapter.state_dict().items()}, "reported": self.reported}

    def resources(self) -> dict[str, int]:
        """``{"pid", "fds", "rss_bytes", "held_bytes", "fds_before_gc"}`` of this process, counted after a full gc and
        ``malloc_trim`` (``held_bytes``: anonymous resident bytes less a host-memory device's cache)."""
        import gc

        from hal.apps.weightsync.memory import (device_cache_in_host_bytes, held_resident_bytes, resident_bytes,
                                                trim_host_heap)

        before = len(os.listdir("/proc/self/fd"))
        gc.collect()
        trim_host_heap()
        out = {"pid": os.getpid(), "fds": len(os.listdir("/proc/self/fd")), "rss_bytes": resident_bytes(),
               "held_bytes": held_resident_bytes() - device_cache_in_host_bytes(self.worker.options.rank_device),
               "fds_before_gc": before}
        traced = self.traced_growth()
        if traced is not None:
            out["traced_growth"] = traced
        return out

    def traced_growth(self, top: int = 5) -> list[str] | None:
        """Where Python allocations grew since this process's first sample (``top`` lines), when :data:`TRACE_ENV` is
        set; ``None`` otherwise."""
        import tracemalloc

        frames = os.environ.get(TRACE_ENV, "")
        if not frames.isdigit() or int(frames) < 1:
            return None
        if not tracemalloc.is_tracing():
            tracemalloc.start(int(frames))
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        if self._first_snapshot is None:
            self._first_snapshot = snapshot
            return []
        return [str(stat) for stat in snapshot.compare_to(self._first_snapshot, "lineno")[:top]]

    def record_bytes(self, nbytes: int) -> None:
        """An update through this worker carried ``nbytes`` (see :attr:`min_bytes`)."""
        if nbytes > 0:
            self.min_bytes = min(self.min_bytes, nbytes) if self.min_bytes else nbytes

    # -- strikes --------------------------------------------------------------------------------------------

    def due(self, moment: str, update: int | None) -> Fault | None:
        """The armed fault if it strikes at ``moment`` of ``update``."""
        fault = self.armed
        if fault is None or fault.moment != moment or (update is not None and update != fault.update):
            return None
        return fault

    def strike(self, fault: Fault, tensor: Any = None) -> Any:
        """Strike ``fault`` now (disarmed first); returns ``tensor``, or a copy with one byte flipped for a ``flip``."""
        self.armed = None
        kind = fault.kind
        if kind == "flip":
            import torch

            flipped = tensor.detach().clone()
            flat = flipped.reshape(-1).view(torch.uint8)
            flat[fault.byte % flat.numel()] ^= FLIP_MASK
            self.notify(("struck", fault, time.time()))
            return flipped
        if kind in ("full_disk", "full_shm"):
            directory = self.surroundings.disk_dir if kind == "full_disk" else self.surroundings.shm_dir
            if directory is None:
                raise RuntimeError(f"{kind} armed without a filesystem to fill (the soak's sandbox has none)")
            fill(directory)
        elif kind in ("cut_link", "slow_link"):
            net, endpoint = self.surroundings.network, self.surroundings.endpoint
            if net is None:
                raise RuntimeError(f"{kind} armed without an emulated network (the soak's sandbox has none)")
            if kind == "slow_link":
                net.set_rate(endpoint, SLOW_RATE_BPS)
            else:
                subprocess.run(["ip", "-n", net.namespace(endpoint), "link", "set", net.ifname, "down"],
                               check=True, capture_output=True, timeout=LINK_CMD_TIMEOUT_S)
        self.notify(("struck", fault, time.time()))
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)  # the driver sends SIGCONT once the stop outlasted the timeout
        return tensor


# the Host methods the driver calls (through Host.invoke)
HOST_CALLS = (Host.arm, Host.disarm, Host.observe, Host.resources)


class StrikingEngine:
    """``engine`` with :class:`Host`'s strikes at their moments; every other attribute is ``engine``'s."""

    def __init__(self, engine: Any, host: Host | None = None) -> None:
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_host", host)

    @classmethod
    def wrap(cls, engine: Any) -> StrikingEngine:
        """``engine`` behind a subclass carrying the engine class's memory figures."""
        engine_cls = type(engine)
        attrs = {name: getattr(engine_cls, name) for name in ("send_buffer_bytes", "send_buffer_words")
                 if hasattr(engine_cls, name)}
        return type(f"Striking{engine_cls.__name__}", (cls,), attrs)(engine)

    def attach(self, host: Host) -> None:
        """Strike ``host``'s armed faults."""
        object.__setattr__(self, "_host", host)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_engine"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._engine, name, value)

    async def send_weights(self, weights: Iterable[Any], global_steps: int | None = None, **kwargs: Any) -> None:
        host = self._host
        if host is not None:
            host.current = global_steps
            fault = host.due("before_send", global_steps)
            if fault is not None:
                host.strike(fault)
            fault = host.due("mid_bucket", global_steps)
            if fault is not None:
                weights = self._counting(weights, fault)
        return await self._engine.send_weights(weights, global_steps, **kwargs)

    def _counting(self, weights: Iterable[Any], fault: Fault) -> Iterable[Any]:
        """``weights`` striking ``fault`` once ``fault.fraction`` of the update's bytes were handed on."""
        host = self._host
        items = list(weights) if isinstance(weights, (list, tuple)) else None
        total = byte_count(items) if items is not None else host.min_bytes
        threshold = fault.fraction * total
        seen = 0
        for name, tensor in items if items is not None else weights:
            seen += tensor.numel() * tensor.element_size()
            if host.armed is fault and seen >= threshold:
                host.strike(fault)
            yield name, tensor
        if host.armed is fault:
            host.strike(fault)
        host.record_bytes(seen)

    def receive_weights(self, global_steps: int | None = None, **kwargs: Any) -> AsyncIterator[Any]:
        return self._receive(global_steps, **kwargs)

    async def _receive(self, global_steps: int | None, **kwargs: Any) -> AsyncIterator[Any]:
        stream = self._engine.receive_weights(global_steps, **kwargs)
        try:
            async for item in self._strike_in(stream, global_steps):
                yield item
        finally:  # closed early (the consumer's aclose): the engine's own stream is closed now, not when collected
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _strike_in(self, stream: AsyncIterator[Any], global_steps: int | None) -> AsyncIterator[Any]:
        host = self._host
        if host is None:
            async for item in stream:
                yield item
            return
        host.current = global_steps
        fault = host.due("before_send", global_steps)
        if fault is not None:
            host.strike(fault)
        middle = host.due("mid_bucket", global_steps)
        threshold = middle.fraction * host.min_bytes if middle is not None else 0.0
        seen = 0
        if middle is not None and middle.kind == "flip":
            # one item held back, copied (it may be a view valid until the next): a short stream's last is flipped
            held = None
            async for name, tensor in stream:
                seen += tensor.numel() * tensor.element_size()
                if held is not None:
                    yield held
                held = (name, tensor.detach().clone())
                if host.armed is middle and seen >= threshold and tensor.numel():
                    held = (name, host.strike(middle, held[1]))
            if held is not None:
                if host.armed is middle and held[1].numel():
                    held = (held[0], host.strike(middle, held[1]))
                yield held
        else:
            async for name, tensor in stream:
                seen += tensor.numel() * tensor.element_size()
                if middle is not None and host.armed is middle and seen >= threshold:
                    host.strike(middle)
                yield name, tensor
        host.record_bytes(seen)
        if middle is not None and host.armed is middle and middle.kind != "flip":
            host.strike(middle)  # a stream shorter than the reference: at its end
        fault = host.due("during_apply", global_steps)
        if fault is not None:
            host.strike(fault)

    def finalize(self, *args: Any, **kwargs: Any) -> Any:
        host = self._host
        if host is not None:
            fault = host.due("during_finalize", host.current)
            if fault is not None:
                host.strike(fault)
        return self._engine.finalize(*args, **kwargs)


def byte_count(weights: Iterable[tuple[str, Any]]) -> int:
    """Bytes of ``(name, tensor)`` pairs."""
    return sum(t.numel() * t.element_size() for _, t in weights)


def remove_ballast(directory: str | None) -> bool:
    """Remove :data:`BALLAST` from ``directory`` if it is there; returns whether it was."""
    if directory is None:
        return False
    try:
        os.unlink(os.path.join(directory, BALLAST))
        return True
    except FileNotFoundError:
        return False


__all__ = ["BALLAST", "Host", "SLOW_RATE_BPS", "StrikingEngine", "Surroundings", "byte_count", "fill",
           "remove_ballast"]
