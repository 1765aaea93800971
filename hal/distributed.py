"""Process groups on the resolved device kind, with timeouts that turn a missing peer into an error.

Two ways in:

* :func:`init_process_group` - the default (training) group of ``torch.distributed``, launched by
  ``torch.distributed.run``: picks the kind's backend and binds ``LOCAL_RANK``'s device.
* :func:`new_group_from_store` - a standalone group built from a ``torch.distributed`` store, outside the
  default world. Trainer and rollout processes are usually not one training world, so checkpoint engines
  form their own group this way and keep it across updates (rebuilding a communicator per update
  exhausts HCCL resources, a failure reported upstream).
"""

from __future__ import annotations

import datetime
import errno
import os
import random
import socket
import threading
import time
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from hal.device import DeviceLike, bind_local_device, get_dist_backend, get_torch_device, resolve_device
from hal.errors import DistributedTimeoutError

DEFAULT_TIMEOUT_S = 300.0
"""Default timeout of rendezvous and collectives, in seconds (torch's own default is 10-30 minutes)."""

Timeout = float | int | datetime.timedelta


def as_timedelta(timeout: Timeout | None) -> datetime.timedelta:
    """Seconds (float) or a timedelta -> timedelta; ``None`` -> :data:`DEFAULT_TIMEOUT_S`.

    Raises:
        ValueError: the timeout is not positive.
    """
    if timeout is None:
        timeout = DEFAULT_TIMEOUT_S
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {timeout.total_seconds()} s")
    return timeout


RENDEZVOUS_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, dist.DistError)
"""What a rendezvous or store call raises when a peer or the store's host is missing, by type: torch's
``DistStoreError`` (a key not set in time), ``DistNetworkError`` (the store's host unreachable) and
``DistBackendError`` are all ``torch.distributed.DistError``."""


def peer_failure(exc: BaseException) -> bool:
    """Whether ``exc``, raised by waiting on a collective, means a peer is dead, stuck or gone.

    Classified by type only: ``TimeoutError``, torch's store and network errors (``DistStoreError``,
    ``DistNetworkError``), and a plain ``RuntimeError`` (exactly that type), which is what gloo raises for
    both a timeout and a connection closed by its peer (torch 2.13 gives those no finer type). A backend's
    own typed error (``DistBackendError``, e.g. the sim's "Duplicate NPU detected") and ``RuntimeError``
    subclasses such as ``NotImplementedError`` pass through unchanged: they say what is wrong themselves.
    """
    return isinstance(exc, (TimeoutError, dist.DistStoreError, dist.DistNetworkError)) or type(exc) is RuntimeError


def init_process_group(
    device: DeviceLike = None,
    *,
    backend: str | None = None,
    timeout: Timeout | None = None,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    with_host: bool = False,
    store: dist.Store | None = None,
) -> str:
    """Initialise the default ``torch.distributed`` group on the resolved kind.

    Args:
        device: the kind (see :func:`hal.resolve_device`).
        backend: override of the backend name; by default the kind's (nccl / hccl / gloo), or with
            ``with_host`` the pair ``"cpu:gloo,<name>:<backend>"``.
        timeout: seconds (or timedelta) for the rendezvous and every collective; default
            :data:`DEFAULT_TIMEOUT_S`.
        init_method, rank, world_size: as in ``torch.distributed.init_process_group``; by default read
            from the ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` variables that
            ``torch.distributed.run`` sets.
        store: a store to rendezvous over instead of ``init_method`` (with ``rank`` and ``world_size``), e.g.
            a ``torch.distributed.PrefixStore`` over :func:`connect_store`'s, for a group of some of the
            launched processes (under ``torch.distributed.run`` a ``tcp://`` ``init_method`` would join the
            agent's store, not the one it names).

    Returns:
        The backend string used.

    Raises:
        DistributedTimeoutError: a peer did not join within ``timeout``.
        UnknownDeviceError, DeviceUnavailableError: see :func:`hal.resolve_device`.
        DeviceIndexError: ``LOCAL_RANK`` (or an explicit index) has no device here (see
            :func:`hal.bind_local_device`).
    """
    spec = resolve_device(device)
    backend = backend or get_dist_backend(spec, with_host=with_host)
    local_device = bind_local_device(device)
    td = as_timedelta(timeout)
    kwargs = {}
    if not spec.host_memory and "," not in backend:
        # device_id binds the group to one device (eager communicator init on NCCL/HCCL).
        kwargs["device_id"] = local_device
    try:
        dist.init_process_group(
            backend=backend, init_method=init_method, timeout=td, store=store,
            rank=-1 if rank is None else rank, world_size=-1 if world_size is None else world_size, **kwargs)
    except RENDEZVOUS_ERRORS as exc:
        raise DistributedTimeoutError(
            f"rendezvous for a {backend} group of world size {world_size or os.environ.get('WORLD_SIZE')} "
            f"did not complete within {td.total_seconds():g} s (a peer is missing): {exc}") from exc
    return backend


class StoreGroup:
    """A standalone communicator over ``world_size`` processes, outside the default ``torch.distributed`` world.

    Every collective blocks until done or until ``timeout`` passes, then raises
    :class:`DistributedTimeoutError` (a dead or missing peer never hangs the caller). Tensors must live on
    the group's device kind (``device.name``), except on gloo which also takes host tensors.
    """

    def __init__(self, backend, rank: int, world_size: int, timeout: datetime.timedelta, spec) -> None:
        self.backend = backend
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.spec = spec

    def wait_for(self, work, what: str) -> None:
        """Wait for ``work`` (a c10d ``Work`` of this group) within the group's timeout; ``what`` names it in errors.

        Raises:
            DistributedTimeoutError: it did not complete in time, or a peer is dead or missing.
        """
        try:
            ok = work.wait(self.timeout)
        except Exception as exc:
            if peer_failure(exc):
                raise DistributedTimeoutError(
                    f"{what} on rank {self.rank}/{self.world_size} ({self.spec.dist_backend}) failed within "
                    f"{self.timeout.total_seconds():g} s, a peer is dead or missing: {exc}") from exc
            raise
        if ok is False:
            raise DistributedTimeoutError(f"{what} on rank {self.rank} did not complete within "
                                          f"{self.timeout.total_seconds():g} s")

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> PendingWork | None:
        """In-place broadcast of ``tensor`` from rank ``src`` to every rank.

        With ``async_op=True`` the call only enqueues the broadcast and returns a :class:`PendingWork`
        whose ``wait()`` blocks (at most ``timeout``); ``tensor`` must not be touched until then.

        Raises:
            DistributedTimeoutError: (without ``async_op``) the broadcast did not complete within the group's
                timeout, or a peer's connection failed or closed (a dead or missing peer).
        """
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        opts.timeout = self.timeout
        work = self.backend.broadcast([tensor], opts)
        if async_op:
            return PendingWork(self, work, f"broadcast from rank {src}")
        self.wait_for(work, f"broadcast from rank {src}")
        return None

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
        """In-place all-reduce of ``tensor``.

        Raises:
            DistributedTimeoutError: it did not complete within the group's timeout, or a peer's connection
                failed or closed (a dead or missing peer).
        """
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        opts.timeout = self.timeout
        self.wait_for(self.backend.allreduce([tensor], opts), "all_reduce")

    def barrier(self) -> None:
        """Block until every rank reaches the barrier, by an all-reduce of one element on the group device.

        Raises:
            DistributedTimeoutError: see :meth:`all_reduce`.
        """
        device = torch.device("cpu") if self.spec.host_memory else torch.device(
            self.spec.name, get_torch_device(self.spec).current_device())
        self.all_reduce(torch.zeros(1, device=device))

    def close(self) -> None:
        """Release the communicator (also done when the object is collected)."""
        shutdown = getattr(self.backend, "shutdown", None) or getattr(self.backend, "abort", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:  # noqa: BLE001 - a torn-down peer can make shutdown itself fail; nothing is left to free
                pass
        self.backend = None


class PendingWork:
    """An enqueued collective of a :class:`StoreGroup`; ``wait()`` blocks at most the group's timeout.

    Raises (from ``wait``):
        DistributedTimeoutError: the collective did not complete in time, or a peer died.
        Whatever ``poll`` raises.
    """

    def __init__(self, group: StoreGroup, work, what: str) -> None:
        self._group, self._work, self._what = group, work, what

    def wait(self, poll: Callable[[], None] | None = None, every: float = 0.25) -> None:
        """Block until the collective completes, at most the group's timeout.

        Args:
            poll: called every ``every`` seconds while the collective is pending; it may raise (e.g. when
                the peer waited on said elsewhere that it left), which ends the wait with that exception
                and leaves the collective pending. Polled only on backends whose work completes its
                future asynchronously (gloo's); the simulated npu's ``get_future`` runs the collective first.
            every: seconds between polls.
        """
        if self._work is None:
            return
        work, self._work = self._work, None
        if poll is not None:
            done = threading.Event()  # set when the work completes or fails (no exception per poll: costly)
            work.get_future().add_done_callback(lambda _: done.set())
            deadline = time.monotonic() + self._group.timeout.total_seconds()
            while not done.wait(every) and time.monotonic() < deadline:
                poll()
        self._group.wait_for(work, self._what)


def new_group_from_store(
    store: dist.Store,
    rank: int,
    world_size: int,
    device: DeviceLike = None,
    timeout: Timeout | None = None,
    prefix: str = "hal",
) -> StoreGroup:
    """Form a standalone group from a store and the kind's backend (nccl / hccl / gloo).

    Args:
        store: a ``torch.distributed`` store (e.g. ``TCPStore(host, port, world_size, is_master=rank==0)``)
            shared by the ``world_size`` processes; ``prefix`` namespaces the keys so one store can serve
            several groups.
        rank: this process's rank in the group, ``0 <= rank < world_size``.
        timeout: seconds for the rendezvous and every collective.

    Raises:
        ValueError: bad rank or world size.
        DistributedTimeoutError: the peers did not all join within ``timeout``.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    spec = resolve_device(device)
    td = as_timedelta(timeout)
    store.set_timeout(td)
    try:
        backend = spec.create_backend(dist.PrefixStore(f"{prefix}/", store), rank, world_size, td)
    except RENDEZVOUS_ERRORS as exc:
        raise DistributedTimeoutError(
            f"rendezvous of group {prefix!r} ({spec.dist_backend}, world size {world_size}) did not "
            f"complete within {td.total_seconds():g} s: {exc}") from exc
    return StoreGroup(backend, rank, world_size, td, spec)


EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
"""Where Linux keeps the range it draws the local port of every outgoing connection from (``ip-sysctl``)."""

_LOWEST_PICKED_PORT = 10_000  # well above the registered ports services are commonly configured on
# its own generator, seeded by the OS: processes that seeded `random` alike must not draw the same ports, and
# picking a port must not move the caller's `random` stream (ranks seeded alike would drift apart)
_port_random = random.SystemRandom()


def ephemeral_port_range() -> tuple[int, int] | None:
    """The kernel's ``(low, high)`` ephemeral port range (inclusive), from which it picks the local port of
    every outgoing TCP connection; ``None`` where :data:`EPHEMERAL_RANGE_FILE` cannot be read (not Linux)."""
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            low, high = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return None
    return low, high


def first_bindable_port(host: str, candidates: Iterable[int]) -> int | None:
    """The first of ``candidates`` that a TCP socket on ``host`` (IPv4) can bind right now, ``None`` if none
    can. A port in use is skipped; any other failure is raised.

    Raises:
        OSError: ``host`` is not a local IPv4 address.
    """
    for port in candidates:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    continue
                raise
            return port
    return None


def pick_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` (an IPv4 address) that was free a moment ago, chosen below the kernel's
    ephemeral range.

    For a rendezvous whose address must be known before its server starts (a store hosted by rank 0 of
    processes not started yet). Binding port 0 would return a port from the ephemeral range, which the
    kernel also hands out as the local port of every outgoing connection on the machine: one of those can
    take the port before its server binds it (it failed a CI run). So the port is drawn at random from
    ``[10000, low)``, where ``low`` starts the range in :data:`EPHEMERAL_RANGE_FILE`, and tried by binding it;
    only where that range cannot be read or offers no free port does the operating system choose (port 0).
    Another process that picks ports explicitly may still take it before it is bound again; the
    rendezvous then fails with an error naming the address, never a hang.

    Raises:
        OSError: ``host`` is not a local IPv4 address.
    """
    span = ephemeral_port_range()
    if span is not None and span[0] > _LOWEST_PICKED_PORT:
        candidates = range(_LOWEST_PICKED_PORT, span[0])
        port = first_bindable_port(host, _port_random.sample(candidates, k=min(64, len(candidates))))
        if port is not None:
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def connect_store(host: str, port: int, rank: int, world_size: int, timeout: Timeout | None = None,
                  is_master: bool | None = None) -> dist.TCPStore:
    """A ``TCPStore`` whose rank 0 hosts the server (``is_master``: whether this process does; ``False`` joins a
    server another process hosts, such as torch's elastic agent); waits at most ``timeout`` for the server.

    Raises:
        DistributedTimeoutError: the server did not come up within ``timeout``.
    """
    td = as_timedelta(timeout)
    hosting = (rank == 0) if is_master is None else is_master
    try:
        return dist.TCPStore(host, port, world_size, is_master=hosting, timeout=td, wait_for_workers=False)
    except RENDEZVOUS_ERRORS as exc:
        # hosting fails at once (the port is taken): saying "within 30 s" would send the reader the wrong way
        what = ("could not host the rendezvous store at {}:{} (this process was to serve it: rank 0, or "
                "is_master=True; to join one another process serves, pass is_master=False)" if hosting else
                f"could not reach the rendezvous store at {{}}:{{}} within {td.total_seconds():g} s")
        raise DistributedTimeoutError(f"{what.format(host, port)}: {exc}") from exc


def launcher_store(timeout: Timeout | None = None, prefix: str | None = None) -> dist.Store:
    """The store of the launcher that started this rank, under ``prefix`` when given (``None``: no prefix).

    torch's own ``env://`` rule (``torch.distributed.rendezvous``): where the launcher shares its store
    (``TORCHELASTIC_USE_AGENT_STORE=True``: torchrun's elastic agent, or :func:`hal.multiprocess.run_multiprocess`)
    every rank joins the one it hosts at ``MASTER_ADDR:MASTER_PORT``; otherwise rank 0 hosts one there
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``). Ranks that meet here need no port of their own: a checkpoint
    engine's master hosts its rendezvous on a port the kernel picks and says where in ``prepare()``.

    Raises:
        KeyError: not a launched rank: no ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` or ``WORLD_SIZE``.
        DistributedTimeoutError: the store did not answer within ``timeout``.
    """
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = connect_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["RANK"]),
                          int(os.environ["WORLD_SIZE"]), timeout=timeout, is_master=False if agent else None)
    return store if prefix is None else dist.PrefixStore(prefix, store)


__all__: Sequence[str] = [
    "DEFAULT_TIMEOUT_S", "as_timedelta", "bind_local_device", "init_process_group", "StoreGroup", "PendingWork",
    "new_group_from_store", "connect_store", "launcher_store", "pick_port", "first_bindable_port", "ephemeral_port_range",
]


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a zombie, dead but not yet reaped, counts as dead): how a
    waiting peer tells a dead process from a slow one."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
