"""Process groups on the resolved device kind, with timeouts that turn a missing peer into an error.

:func:`init_process_group` sets up the default (training) group under ``torch.distributed.run``;
:func:`new_group_from_store` forms a standalone group from a store, which checkpoint engines keep across
updates (rebuilding a communicator per update exhausts HCCL resources).
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from hal.device import DeviceLike, get_dist_backend, get_torch_device, resolve_device, set_device
from hal.errors import DistributedTimeoutError

# Default timeout of rendezvous and collectives, in seconds (torch's own default is 10-30 minutes).
DEFAULT_TIMEOUT_S = 300.0

Timeout = float | int | datetime.timedelta


def as_timedelta(timeout: Timeout | None) -> datetime.timedelta:
    """Convert seconds or a timedelta to a positive timedelta (``None``: :data:`DEFAULT_TIMEOUT_S`)."""
    if timeout is None:
        timeout = DEFAULT_TIMEOUT_S
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {timeout.total_seconds()} s")
    return timeout


# What a rendezvous or store call raises when a peer or the store's host is missing (DistError covers
# DistStoreError, DistNetworkError, DistBackendError).
RENDEZVOUS_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, dist.DistError)


def peer_failure(exc: BaseException) -> bool:
    """Return whether ``exc``, raised by waiting on a collective, means a peer is dead, stuck or gone.

    By type only: TimeoutError, torch's store/network errors and a plain RuntimeError (gloo's timeout and closed
    connection); a backend's typed error and RuntimeError subclasses pass through.
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
    """Initialise the default ``torch.distributed`` group on the resolved kind and return the backend used.

    ``timeout`` is in seconds (default :data:`DEFAULT_TIMEOUT_S`); ``init_method``/``rank``/``world_size`` default to
    torchrun's variables; ``store`` rendezvouses over a given store instead. Binds the local device first;
    raises DistributedTimeoutError when a peer does not join in time.
    """
    spec = resolve_device(device)
    backend = backend or get_dist_backend(spec, with_host=with_host)
    local_device = set_device(device)
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

    Every collective raises DistributedTimeoutError after ``timeout`` (a dead peer never hangs the caller).
    Tensors live on the group's device kind; gloo also takes host tensors.
    """

    def __init__(self, backend, rank: int, world_size: int, timeout: datetime.timedelta, spec) -> None:
        self.backend = backend
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.spec = spec

    def wait_for(self, work, what: str) -> None:
        """Wait for ``work`` within the group's timeout; ``what`` names it in the DistributedTimeoutError."""
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
        """Broadcast ``tensor`` in place from rank ``src``.

        With ``async_op=True`` return a :class:`PendingWork`; leave ``tensor`` alone until its ``wait()``.
        """
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        opts.timeout = self.timeout
        work = self.backend.broadcast([tensor], opts)
        if async_op:
            return PendingWork(self, work, f"broadcast from rank {src}")
        self.wait_for(work, f"broadcast from rank {src}")
        return None

    def send(self, tensor: torch.Tensor, dst: int) -> PendingWork:
        """Post a send of ``tensor`` (contiguous) to rank ``dst``; leave it untouched until ``wait()``."""
        return PendingWork(self, self.backend.send([tensor], dst, 0), f"send to rank {dst}", pollable=False)

    def recv(self, tensor: torch.Tensor, src: int) -> PendingWork:
        """Post a receive into ``tensor`` (contiguous) from rank ``src``; read it only after ``wait()``."""
        return PendingWork(self, self.backend.recv([tensor], src, 0), f"receive from rank {src}", pollable=False)

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
        """All-reduce ``tensor`` in place."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        opts.timeout = self.timeout
        self.wait_for(self.backend.allreduce([tensor], opts), "all_reduce")

    def barrier(self) -> None:
        """Block until every rank reaches the barrier."""
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
    """An enqueued collective of a :class:`StoreGroup`; ``wait()`` blocks at most the group's timeout."""

    def __init__(self, group: StoreGroup, work, what: str, pollable: bool = True) -> None:
        self._group, self._work, self._what = group, work, what
        self._pollable = pollable  # gloo's send/recv works have no future to poll on: waited plainly

    def wait(self, poll: Callable[[], None] | None = None, every: float = 0.25) -> None:
        """Block until the collective completes, at most the group's timeout.

        ``poll`` runs every ``every`` seconds while pending (gloo only) and may raise to end the wait.
        """
        if self._work is None:
            return
        work, self._work = self._work, None
        if poll is not None and self._pollable:
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
    """Form a standalone group of ``world_size`` processes from ``store`` and the kind's backend.

    ``prefix`` namespaces the keys so one store serves several groups; ``timeout`` is in seconds.
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


def connect_store(host: str, port: int, rank: int, world_size: int, timeout: Timeout | None = None,
                  is_master: bool | None = None) -> dist.TCPStore:
    """Return a ``TCPStore`` at ``host:port``, hosting its server when ``is_master``; waits at most ``timeout``."""
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
    """Return the store of the launcher that started this rank, under ``prefix`` when given.

    Follows torch's ``env://`` rule (agent's shared store, else rank 0 hosts one at MASTER_ADDR:MASTER_PORT);
    raises KeyError outside a launched rank.
    """
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = connect_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["RANK"]),
                          int(os.environ["WORLD_SIZE"]), timeout=timeout, is_master=False if agent else None)
    return store if prefix is None else dist.PrefixStore(prefix, store)


__all__: Sequence[str] = [
    "DEFAULT_TIMEOUT_S", "as_timedelta", "set_device", "init_process_group", "StoreGroup", "PendingWork",
    "new_group_from_store", "connect_store", "launcher_store",
]


def process_alive(pid: int) -> bool:
    """Return whether process ``pid`` of this host runs (a zombie counts as dead)."""
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
