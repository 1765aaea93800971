"""The ``hccl`` collective backend of the simulated NPU: gloo underneath, on the npu tensors' own bytes.

Registered as torch_npu registers HCCL: ``Backend.register_backend("hccl", ..., extended_api=True,
devices=["npu"])`` (a list: torch 2.13 splits a string into characters). The creator returns
:class:`SimHcclGroup`, a Python ``torch.distributed.ProcessGroup`` subclass (the pattern of PyTorch's
``test_c10d_pypg`` and ``multi_threaded_pg``) wrapping a ``ProcessGroupGloo``. npu memory is host memory,
so each npu tensor is handed to gloo as a cpu tensor over the same bytes (no staging copy).

Collectives complete asynchronously, as on HCCL's stream, so that a missing ``wait`` shows up on the sim:
a call only queues the operation (arguments are checked at once) and returns a :class:`SimWork`. Each
group runs its queued operations in issue order, on every rank alike (ranks must issue them in the same
order, as with HCCL), and only when one is needed: ``work.wait()`` (which also runs every operation
issued before it on the group; the synchronous calls, ``async_op=False``, wait at once and behave as
before), ``work.get_future()`` (a future's own ``wait`` cannot be seen here: DDP's reducer takes one),
``torch.npu.synchronize(device)`` (every group whose device is ``device``), :meth:`SimHcclGroup.shutdown`
(``destroy_process_group``; :meth:`SimHcclGroup.abort` drops them instead). Until then the operation has
not read its input nor written its output: a sender that changes its tensor before waiting sends the
changed bytes, a receiver that reads before waiting reads what was there before. ``work.is_completed()``
only reports. An operation runs within the group's timeout or raises ``hal.DistributedTimeoutError`` (a
missing or dead peer) from ``wait``; the operations queued behind a failed one fail with it, unrun.

Like NCCL ("Duplicate GPU detected") and HCCL, a communicator refuses two ranks on one device: the
first collective of a group exchanges each rank's device (host, and the physical id behind
``ASCEND_RT_VISIBLE_DEVICES``; the host is ``$HAL_SIM_HOST`` where set) and every rank raises
``torch.distributed.DistBackendError`` naming both ranks if two share one, so code that forgets to bind
each rank's device fails on any machine. The device is the one current when the collective is issued.
Covered: broadcast, allreduce (SUM/PRODUCT/MIN/MAX, and AVG as SUM then divide; gloo has no AVG),
allreduce_coalesced, allgather, all_gather_single (``all_gather_into_tensor``, ``_allgather_base``),
reduce_scatter, reduce_scatter_single (``reduce_scatter_tensor``, ``_reduce_scatter_base``), barrier,
send/recv, all_to_all_single, and (called from Python) reduce, gather, scatter; DDP and FSDP2
(``fully_shard``, ``DTensor.full_tensor()``) run on it in eager mode.

Collectives that C++ starts (functional collectives: ``DTensor.full_tensor()``, redistribution; DDP's
reducer) reach a Python process group only through the names torch's ``PyProcessGroup`` trampoline
forwards (``torch/csrc/distributed/c10d/PyProcessGroup.hpp``): allgather, all_gather_single_coalesced,
allreduce(_coalesced), all_to_all_single, barrier, broadcast, reduce_scatter(_single_coalesced), send,
recv; all of them are defined here, and those callers wait on the work (``wait_tensor``, the reducer's
future) themselves. The other names (gather, scatter, reduce when C++ calls them) reach the wrapped gloo
directly, on the npu tensors' bytes, past this class's checks and queue (so at once, ahead of any queued
operation). Started from C++, such a call also holds the caller's GIL into gloo: gloo's worker thread
drops a finished op's tensors while holding its queue lock, dropping a tensor that Python has seen takes
the GIL (PyTorch keeps a tensor's Python object alive while C++ holds it), so a caller that enqueues with
the GIL held can deadlock with that thread. Here every gloo call goes through its Python binding, which
releases the GIL first, whichever thread runs the queue.
"""

from __future__ import annotations

import collections
import datetime
import itertools
import os
import socket
import threading
import time
import weakref
import zlib
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from devices import torch_compat
from devices.errors import DistributedTimeoutError

BACKEND_NAME = "hccl"
_ext = None

_groups: weakref.WeakValueDictionary[int, SimHcclGroup] = weakref.WeakValueDictionary()
"""The live groups of this process by creation number (what :func:`synchronize` runs, oldest first)."""
_group_ids = itertools.count()


class SimWork(torch_compat.Work):
    """One issued collective of a :class:`SimHcclGroup`: queued until needed (see the module doc).

    ``wait()`` runs it (and every operation issued before it on the group) and returns ``True``, or raises
    what it raised (``hal.DistributedTimeoutError`` for a missing or dead peer); ``get_future()`` does the
    same and returns a completed future of the output tensors; ``is_completed()`` says whether it has run.
    ``what`` names the collective in errors (``"all_reduce"``).
    """

    def __init__(self, group: SimHcclGroup, what: str, run: Callable[[], None],
                 result: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self._group, self.what, self._fn, self._result = group, what, run, list(result)
        self._done = False
        self._error: BaseException | None = None

    def execute(self) -> None:
        """Run the operation now (the group's runner calls this, in issue order)."""
        fn, self._fn = self._fn, None
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - kept and raised by wait(), as HCCL's work does
            self._error = exc
        finally:
            self._done = True

    def fail(self, error: BaseException) -> None:
        """Complete without running: ``wait()`` raises ``error``."""
        self._fn, self._error, self._done = None, error, True

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Run this collective (and those issued before it on the group) unless done; ``True`` when done.

        Raises:
            DistributedTimeoutError: it did not complete within the group's timeout, or a peer died.
            Whatever else the collective raised (``DistBackendError`` for two ranks on one device).
        """
        if not self._done:
            self._group.run_until(self)
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """Whether the collective has run (it runs only when needed, see the module doc)."""
        return self._done

    def is_success(self) -> bool:
        """Whether the collective has run without error."""
        return self._done and self._error is None

    def exception(self) -> BaseException | None:
        """What the collective raised when it ran (``None``: not run yet, or no error)."""
        return self._error

    def result(self) -> list[torch.Tensor]:
        """The output tensors (written once the collective has run)."""
        return self._result

    def get_future(self) -> torch.futures.Future:
        """A completed future of the output tensors (or of the error): the collective runs now."""
        fut: torch.futures.Future = torch.futures.Future()
        try:
            self.wait()
        except Exception as exc:  # noqa: BLE001 - handed to the future's waiter
            fut.set_exception(without_frames(exc))
        else:
            fut.set_result(self._result)
        return fut


def without_frames(exc: BaseException) -> BaseException:
    """``exc`` with the tracebacks of it and of every exception it chains (``__cause__``, ``__context__``) dropped.

    For an exception handed to a ``torch.futures.Future``: the future is a C++ object, whose reference to the
    exception the garbage collector cannot see. A traceback frame of the collective's call stack holds the
    future (:meth:`SimWork.get_future`'s own, through every deeper frame's ``f_back``) and the group, so the
    future, the exception, the group and its gloo communicator (sockets, an epoll loop, threads) would form a
    cycle nothing frees: ``hal soak`` saw each failed receive leak 5 descriptors on npu-sim.
    """
    seen, e = set(), exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return exc


def synchronize(index: int) -> None:
    """Run the queued collectives of every live group of this process whose device is npu ``index``
    (what ``torch.npu.synchronize`` does on the sim: a device's communication streams are drained too).

    Raises:
        DistributedTimeoutError: one did not complete within its group's timeout (a missing or dead peer).
    """
    for _, group in sorted(_groups.items()):
        if group.device_index == index:
            group.flush()


def _op(opts: Any) -> dist.ReduceOp:
    """The reduce op of an options object, SUM when none was passed."""
    return dist.ReduceOp.SUM if opts is None else opts.reduceOp


def _check_tensors(tensors: Sequence[torch.Tensor]) -> None:
    """Raise ``ValueError`` naming the device of a tensor that is neither on npu nor on cpu."""
    for t in tensors:
        if t.device.type not in ("npu", "cpu"):
            raise ValueError(f"the npu-sim hccl backend takes npu or cpu tensors, got one on {t.device}")


def _host(t: torch.Tensor) -> torch.Tensor:
    """A new contiguous cpu tensor over ``t``'s bytes (a copy only when ``t`` is not contiguous): only the
    caller and the gloo op it is handed to hold it, so :meth:`SimHcclGroup._run` can tell when gloo let go."""
    _check_tensors((t,))
    alias = t.detach() if t.device.type == "cpu" else _ext.host_alias(t)
    return alias if alias.is_contiguous() else alias.contiguous()


def physical_device(index: int) -> int:
    """The physical id of this process's device ``index``: its entry of ``ASCEND_RT_VISIBLE_DEVICES`` when
    that is set (``"4,5"``: index 1 is device 5), else ``index`` itself."""
    visible = [v.strip() for v in os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if index < len(visible) and visible[index].lstrip("-").isdigit():
        return int(visible[index])
    return index


SIM_HOST_ENV = "HAL_SIM_HOST"
"""Names the simulated host of a process (default: the host name), so that several simulated nodes on one
machine (a local multi-node Ray cluster) each have their own devices."""


def _host_id() -> int:
    """A 31-bit id of this (simulated) host: CRC-32 of ``$HAL_SIM_HOST``, else of the host name. Ranks on
    other hosts never share a device."""
    return zlib.crc32((os.environ.get(SIM_HOST_ENV) or socket.gethostname()).encode()) & 0x7FFFFFFF


def _write_back(dst: torch.Tensor, host: torch.Tensor) -> None:
    """Copy ``host`` into ``dst`` unless it already aliases ``dst``'s bytes."""
    if host.data_ptr() != dst.data_ptr() or host.stride() != dst.stride():
        dst.copy_(host)


class SimHcclGroup(dist.ProcessGroup):
    """A ``hccl`` process group of the npu-sim kind (see the module doc).

    Args:
        store: the (prefixed) rendezvous store; rank, size: this process's place in the group.
        timeout: bound on the rendezvous and on every collective (timedelta), queued ones included.
    """

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self._rank, self._size, self._timeout = rank, size, timeout
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._device_checked = False
        self.device_index: int | None = None  # of the first collective issued: what synchronize(index) drains
        self._queue: collections.deque[SimWork] = collections.deque()  # issued, not yet run, in issue order
        self._runner = threading.Lock()  # held by the thread running the queue
        self._ran = 0  # operations taken off the queue: tells a busy runner from a stuck one
        _groups[next(_group_ids)] = self
        # C++ callers look a backend up per device (init_process_group with device_id does); gloo answers
        # for host tensors, and for npu ones it rejects what the C++-only paths would hand it.
        for device in ("cpu", "npu"):
            torch_compat.register_group_backend(self, torch.device(device), self._gloo)

    # -- identity
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    # -- the queue
    def _issue(self, what: str, tensors: Sequence[torch.Tensor], run: Callable[[], None],
               result: Sequence[torch.Tensor], check: bool = True) -> SimWork:
        """Queue ``run`` (which does the whole collective when called) and return its work.

        ``tensors`` name the device: that of the first npu one, else the current one. ``check``: the
        collective involves every rank, so it may carry the device check of the group's first one.

        Raises:
            ValueError: a tensor is neither on npu nor on cpu.
            torch.distributed.DistBackendError: the group was shut down.
        """
        _check_tensors(tensors)
        if self._gloo is None:
            raise dist.DistBackendError(f"npu-sim hccl {what} on rank {self._rank}: the group was shut down")
        npu = next((t for t in tensors if t.device.type == "npu"), None)
        index = npu.device.index if npu is not None and npu.device.index is not None else _ext.current_device()
        if self.device_index is None:
            self.device_index = index

        def op() -> None:
            if check:
                self._check_devices(index)
            run()

        work = SimWork(self, what, op, result)
        self._queue.append(work)
        return work

    def run_until(self, work: SimWork) -> None:
        """Run the queued operations in issue order until ``work`` has run (one thread at a time).

        Raises:
            DistributedTimeoutError: another thread running this group's queue made no progress within
                the timeout.
        """
        seconds = self._timeout.total_seconds()
        while not work.is_completed():
            ran = self._ran
            if not self._runner.acquire(timeout=seconds):
                if self._ran == ran:
                    raise DistributedTimeoutError(
                        f"npu-sim hccl {work.what} on rank {self._rank}/{self._size}: the collectives issued "
                        f"before it, run by another thread, made no progress within {seconds:g} s")
                continue
            try:
                while not work.is_completed() and self._queue:
                    head = self._queue.popleft()
                    head.execute()
                    self._ran += 1
                    if head.exception() is not None:
                        self._fail_queued(f"{head.what}, issued before it on this group, failed: {head.exception()}",
                                          head.exception())
            finally:
                self._runner.release()
            if not work.is_completed():  # neither queued nor run: an abort is dropping the queue meanwhile
                raise dist.DistBackendError(f"npu-sim hccl {work.what} on rank {self._rank}/{self._size} was "
                                            "dropped from the queue unrun (the group is being aborted)")

    def _fail_queued(self, why: str, cause: BaseException | None) -> None:
        """Complete every queued operation without running it; their ``wait`` raises, naming ``why``."""
        kind = DistributedTimeoutError if isinstance(cause, DistributedTimeoutError) else dist.DistBackendError
        while self._queue:
            work = self._queue.popleft()
            work.fail(kind(f"npu-sim hccl {work.what} on rank {self._rank}/{self._size} was not run: {why}"))
            self._ran += 1

    def flush(self) -> None:
        """Run every queued operation now (what synchronizing the group's device does).

        Raises:
            DistributedTimeoutError: one did not complete within the timeout (then the later ones fail too).
            Whatever else the last queued one raised.
        """
        try:
            last = self._queue[-1]
        except IndexError:
            return
        last.wait()

    # -- plumbing
    def _run(self, what: str, start: Callable[[], Any], tensors: Sequence[torch.Tensor] = ()) -> None:
        """Start a gloo op on ``tensors`` (every tensor ``start`` hands to gloo, its outputs among them) and
        wait within the timeout, first for the op, then for gloo to let go of ``tensors``.

        The second wait keeps the group destructible. gloo's worker thread frees an op's work object after
        the op completed (its ``wait`` may have returned), holding gloo's queue lock; that frees the op's
        tensors and the thread-local state captured when the op was issued, and either can hold Python
        objects (a tensor Python has seen; a mode or hook object of the issuing thread), whose release
        takes the GIL. ``ProcessGroupGloo``'s destructor takes that lock and joins that thread, with the
        GIL held when the group's last reference goes in Python (a DDP module freed after
        ``destroy_process_group``: its reducer holds the group): a worker still freeing a work object
        then deadlocks the process (seen in a DDP rank under load, at the end of its function). The work
        object frees its outputs last, after its thread-local state, so once gloo holds none of
        ``tensors`` it is gone; waiting for that gives up the GIL.

        Raises:
            DistributedTimeoutError: the op did not complete within the group's timeout, or a peer died
                (gloo reports both as a plain ``RuntimeError``); or gloo still held ``tensors`` a timeout
                after the op completed.
        """
        held = [torch_compat.use_count(t) for t in tensors]  # before gloo takes its own references
        try:
            work = start()
            ok = work.wait(self._timeout)
        except Exception as exc:
            work = None  # gloo's work holds the tensors: let it go before waiting for them
            self._until_released(tensors, held)  # on the way to the error: not raising a second one
            # by type, as hal.distributed.peer_failure: gloo raises a plain RuntimeError for a timeout and for
            # a connection its peer closed (no finer type in torch 2.13)
            if isinstance(exc, (TimeoutError, dist.DistStoreError, dist.DistNetworkError)) or type(exc) is RuntimeError:
                raise DistributedTimeoutError(
                    f"npu-sim hccl {what} on rank {self._rank}/{self._size} failed within "
                    f"{self._timeout.total_seconds():g} s, a peer is missing or dead: {exc}") from exc
            raise
        work = None  # gloo's work holds the tensors: let it go before waiting for them
        released = self._until_released(tensors, held)
        if ok is False:
            raise DistributedTimeoutError(f"npu-sim hccl {what} on rank {self._rank}/{self._size} did not "
                                          f"complete within {self._timeout.total_seconds():g} s")
        if not released:
            raise DistributedTimeoutError(
                f"npu-sim hccl {what} on rank {self._rank}/{self._size}: gloo still held the op's tensors "
                f"{self._timeout.total_seconds():g} s after it completed (its worker thread is stuck)")

    def _until_released(self, tensors: Sequence[torch.Tensor], held: Sequence[int]) -> bool:
        """Sleep (so without the GIL) until each of ``tensors`` is back to ``held`` C++ references, at most
        the group's timeout; whether they are. See :meth:`_run` for why."""
        deadline = time.monotonic() + self._timeout.total_seconds()
        pause = 5e-5
        while any(torch_compat.use_count(t) > n for t, n in zip(tensors, held)):
            if time.monotonic() > deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, 5e-3)
        return True

    def _reduce_op(self, op: Any) -> tuple[dist.ReduceOp, bool]:
        """(the gloo op, whether to divide by the group size afterwards) for a ReduceOp or RedOpType."""
        kind = getattr(op, "op", op)
        if kind == dist.ReduceOp.AVG:
            return dist.ReduceOp.SUM, True
        for ok in (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX):
            if kind == ok:
                return ok, False
        raise ValueError(f"npu-sim hccl supports SUM, AVG, PRODUCT, MIN, MAX; got {kind}")

    def _check_devices(self, index: int) -> None:
        """On the group's first collective: refuse two ranks on one device, as NCCL and HCCL do.

        ``index`` is this rank's npu device when the collective was issued. Every rank takes part (the
        first collective is the same call on every rank) and every rank raises on a clash.

        Raises:
            torch.distributed.DistBackendError: two ranks of this group are on one device of one host.
        """
        if self._device_checked:
            return
        self._device_checked = True
        mine = torch.tensor([_host_id(), physical_device(index), index], dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(self._size)]
        self._run("device check", lambda: self._gloo.allgather([everyone], [mine]), [*everyone, mine])
        seen: dict[tuple[int, int], int] = {}
        for rank, (host, physical, local) in enumerate(t.tolist() for t in everyone):
            if (host, physical) in seen:
                first = seen[(host, physical)]
                raise dist.DistBackendError(
                    f"npu-sim hccl: Duplicate NPU detected: rank {rank} and rank {first} of this communicator "
                    f"(size {self._size}) are both on physical npu device {physical} of one host (local index "
                    f"{local}); each rank needs its own device: bind it before the first collective "
                    f"(hal.bind_local_device(), or torch.npu.set_device(LOCAL_RANK))")
            seen[(host, physical)] = rank

    # -- what a queued collective does when it runs
    def _allreduce_now(self, tensors: Sequence[torch.Tensor], op: dist.ReduceOp, divide: bool) -> None:
        hosts = [_host(t) for t in tensors]
        o = dist.AllreduceOptions()
        o.reduceOp, o.timeout = op, self._timeout
        self._run("allreduce", lambda: self._gloo.allreduce(hosts, o), hosts)
        for t, h in zip(tensors, hosts):
            if divide:
                h.div_(self._size)
            _write_back(t, h)

    def _allgather_now(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> None:
        host_outs = [[_host(t) for t in outs] for outs in output_lists]
        host_ins = [_host(t) for t in inputs]
        self._run("allgather", lambda: self._gloo.allgather(host_outs, host_ins),
                  [*(h for outs in host_outs for h in outs), *host_ins])
        for outs, houts in zip(output_lists, host_outs):
            for t, h in zip(outs, houts):
                _write_back(t, h)

    def _gather_sizes(self, output: torch.Tensor, input: torch.Tensor) -> None:
        if output.numel() != input.numel() * self._size:
            raise ValueError(f"all_gather_single: output has {output.numel()} elements, expected "
                             f"{input.numel()} x {self._size}")

    def _all_gather_single_now(self, output: torch.Tensor, input: torch.Tensor) -> None:
        contiguous = output.is_contiguous()
        flat = output if contiguous else torch.empty(output.numel(), dtype=output.dtype, device=output.device)
        self._allgather_now([list(flat.reshape(self._size, -1).unbind(0))], [input.reshape(-1)])
        if not contiguous:
            output.copy_(flat.view(output.shape))

    def _scatter_sizes(self, output: torch.Tensor, input: torch.Tensor) -> None:
        if input.numel() != output.numel() * self._size:
            raise ValueError(f"reduce_scatter_single: input has {input.numel()} elements, expected "
                             f"{output.numel()} x {self._size}")

    def _reduce_scatter_single_now(self, output: torch.Tensor, input: torch.Tensor, op: dist.ReduceOp,
                                   divide: bool) -> None:
        reduced = input.reshape(-1).clone()
        self._allreduce_now([reduced], op, divide)
        output.copy_(reduced.view(self._size, -1)[self._rank].view(output.shape))

    # -- collectives (each queued, see the module doc)
    def broadcast(self, tensors: list[torch.Tensor], opts=None) -> SimWork:
        root, root_tensor = (opts.rootRank, opts.rootTensor) if opts is not None else (0, 0)

        def run() -> None:
            hosts = [_host(t) for t in tensors]
            o = dist.BroadcastOptions()
            o.rootRank, o.rootTensor, o.timeout = root, root_tensor, self._timeout
            self._run("broadcast", lambda: self._gloo.broadcast(hosts, o), hosts)
            for t, h in zip(tensors, hosts):
                _write_back(t, h)
        return self._issue(f"broadcast from rank {root}", tensors, run, tensors)

    def allreduce(self, tensors: list[torch.Tensor], opts=None) -> SimWork:
        op, divide = self._reduce_op(_op(opts))
        return self._issue("allreduce", tensors, lambda: self._allreduce_now(tensors, op, divide), tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts=None) -> SimWork:
        op, divide = self._reduce_op(_op(opts))

        def run() -> None:
            for t in tensors:
                self._allreduce_now([t], op, divide)
        return self._issue("allreduce_coalesced", tensors, run, tensors)

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts=None) -> SimWork:
        _check_tensors([t for outs in output_lists for t in outs])
        return self._issue("allgather", inputs, lambda: self._allgather_now(output_lists, inputs),
                           [t for outs in output_lists for t in outs])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts=None) -> SimWork:
        """``output`` (``size * input.numel()`` elements, rank-major) gets every rank's ``input``."""
        self._gather_sizes(output, input)
        _check_tensors([output])
        return self._issue("all_gather_single", [input], lambda: self._all_gather_single_now(output, input),
                           [output])

    _allgather_base = all_gather_single
    all_gather_into_tensor = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts=None) -> SimWork:
        """:meth:`all_gather_single` for each ``(output, input)`` pair, in order. The C++ side of a Python
        process group calls this one (functional collectives, so ``DTensor.full_tensor()`` and DTensor
        redistribution); without it C++ would run the wrapped gloo on the npu tensors itself (see the
        module doc)."""
        for out, inp in zip(outputs, inputs):
            self._gather_sizes(out, inp)
        _check_tensors(outputs)

        def run() -> None:
            for out, inp in zip(outputs, inputs):
                self._all_gather_single_now(out, inp)
        return self._issue("all_gather_single_coalesced", inputs, run, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                       opts=None) -> SimWork:
        op, divide = self._reduce_op(_op(opts))
        _check_tensors(outputs)

        def run() -> None:
            for out, inputs in zip(outputs, input_lists):
                stacked = torch.stack([t.reshape(-1) for t in inputs])
                self._allreduce_now([stacked], op, divide)
                out.copy_(stacked[self._rank].view(out.shape))
        return self._issue("reduce_scatter", [t for ins in input_lists for t in ins], run, outputs)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts=None) -> SimWork:
        """``output`` gets this rank's chunk (rank-major) of the reduction of every rank's ``input``."""
        self._scatter_sizes(output, input)
        _check_tensors([output])
        op, divide = self._reduce_op(_op(opts))
        return self._issue("reduce_scatter_single", [input],
                           lambda: self._reduce_scatter_single_now(output, input, op, divide), [output])

    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts=None) -> SimWork:
        """:meth:`reduce_scatter_single` for each ``(output, input)`` pair, in order (the C++ entry of
        functional reduce-scatters, as for :meth:`all_gather_single_coalesced`)."""
        for out, inp in zip(outputs, inputs):
            self._scatter_sizes(out, inp)
        _check_tensors(outputs)
        op, divide = self._reduce_op(_op(opts))

        def run() -> None:
            for out, inp in zip(outputs, inputs):
                self._reduce_scatter_single_now(out, inp, op, divide)
        return self._issue("reduce_scatter_single_coalesced", inputs, run, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int],
                          input_split_sizes: Sequence[int], opts=None) -> SimWork:
        """Rank ``r`` sends the ``r``-th slice (along dim 0) of ``input`` to every rank and receives theirs
        into ``output``; empty split lists mean equal slices (``torch.distributed.all_to_all_single``)."""
        _check_tensors([output])
        out_splits, in_splits = list(output_split_sizes), list(input_split_sizes)

        def run() -> None:
            host_out, host_in = _host(output), _host(input)
            o = dist.AllToAllOptions()
            o.timeout = self._timeout
            self._run("all_to_all_single", lambda: self._gloo.alltoall_base(host_out, host_in, out_splits,
                                                                             in_splits, o), [host_out, host_in])
            _write_back(output, host_out)
        return self._issue("all_to_all_single", [input], run, [output])

    alltoall_base = all_to_all_single

    def reduce(self, tensors: list[torch.Tensor], opts=None) -> SimWork:
        """``tensors`` on rank ``opts.rootRank`` get the reduction of every rank's (``torch.distributed.reduce``)."""
        op, divide = self._reduce_op(_op(opts))
        root, root_tensor = (opts.rootRank, opts.rootTensor) if opts is not None else (0, 0)

        def run() -> None:
            hosts = [_host(t) for t in tensors]
            o = dist.ReduceOptions()
            o.reduceOp, o.rootRank, o.rootTensor, o.timeout = op, root, root_tensor, self._timeout
            self._run("reduce", lambda: self._gloo.reduce(hosts, o), hosts)
            if self._rank == root:
                for t, h in zip(tensors, hosts):
                    if divide:
                        h.div_(self._size)
                    _write_back(t, h)
        return self._issue(f"reduce to rank {root}", tensors, run, tensors)

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts=None) -> SimWork:
        """Rank ``opts.rootRank``'s ``output_lists[0][r]`` gets rank ``r``'s ``inputs[0]``
        (``torch.distributed.gather``; other ranks pass no outputs)."""
        root = opts.rootRank if opts is not None else 0
        _check_tensors([t for outs in output_lists for t in outs])

        def run() -> None:
            host_outs = [[_host(t) for t in outs] for outs in output_lists]
            host_ins = [_host(t) for t in inputs]
            o = dist.GatherOptions()
            o.rootRank, o.timeout = root, self._timeout
            self._run("gather", lambda: self._gloo.gather(host_outs, host_ins, o),
                      [*(h for outs in host_outs for h in outs), *host_ins])
            for outs, houts in zip(output_lists, host_outs):
                for t, h in zip(outs, houts):
                    _write_back(t, h)
        return self._issue(f"gather to rank {root}", inputs, run, [t for outs in output_lists for t in outs])

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts=None) -> SimWork:
        """Rank ``r``'s ``outputs[0]`` gets rank ``opts.rootRank``'s ``input_lists[0][r]``
        (``torch.distributed.scatter``; other ranks pass no inputs)."""
        root = opts.rootRank if opts is not None else 0
        _check_tensors([t for ins in input_lists for t in ins])

        def run() -> None:
            host_outs = [_host(t) for t in outputs]
            host_ins = [[_host(t) for t in ins] for ins in input_lists]
            o = dist.ScatterOptions()
            o.rootRank, o.timeout = root, self._timeout
            self._run("scatter", lambda: self._gloo.scatter(host_outs, host_ins, o),
                      [*host_outs, *(h for ins in host_ins for h in ins)])
            for t, h in zip(outputs, host_outs):
                _write_back(t, h)
        return self._issue(f"scatter from rank {root}", outputs, run, outputs)

    def barrier(self, opts=None) -> SimWork:
        def run() -> None:
            # an allreduce of one element, as StoreGroup.barrier: gloo's own barrier has no output tensor
            # by which _run could tell that gloo has freed it
            one = torch.zeros(1)
            o = dist.AllreduceOptions()
            o.timeout = self._timeout
            self._run("barrier", lambda: self._gloo.allreduce([one], o), [one])
        return self._issue("barrier", (), run, [])

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> SimWork:
        def run() -> None:
            hosts = [_host(t) for t in tensors]
            self._run(f"send to {dst}", lambda: self._gloo.send(hosts, dst, tag), hosts)
        return self._issue(f"send to {dst}", tensors, run, tensors, check=False)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> SimWork:
        def run() -> None:
            hosts = [_host(t) for t in tensors]
            self._run(f"recv from {src}", lambda: self._gloo.recv(hosts, src, tag), hosts)
            for t, h in zip(tensors, hosts):
                _write_back(t, h)
        return self._issue(f"recv from {src}", tensors, run, tensors, check=False)

    def shutdown(self) -> None:
        """Run the queued collectives (as a graceful communicator finalize does), then release the gloo
        communicator.

        Raises:
            DistributedTimeoutError: a queued collective did not complete within the timeout (a dead peer);
                the communicator is released all the same.
        """
        try:
            self.flush()
        finally:
            self._release()

    def abort(self) -> None:
        """Drop the queued collectives (their ``wait`` raises) and release the gloo communicator; a collective
        another thread is running ends with an error once the communicator is gone."""
        self._release()
        held = self._runner.acquire(timeout=self._timeout.total_seconds())
        try:
            self._fail_queued("the group was aborted", None)
        finally:
            if held:
                self._runner.release()

    def _release(self) -> None:
        gloo, self._gloo = self._gloo, None
        if gloo is not None and hasattr(gloo, "shutdown"):
            gloo.shutdown()


def create(opts: Any, backend_options: Any = None) -> SimHcclGroup:
    """The ``extended_api`` creator: ``opts`` is a ``_DistributedBackendOptions`` (store, group_rank,
    group_size, timeout), as ``init_process_group``/``new_group`` and ``hal.new_group_from_store`` pass."""
    return SimHcclGroup(opts.store, opts.group_rank, opts.group_size, opts.timeout)


def register() -> None:
    """Register ``hccl`` with torch.distributed once per process (a second registration would raise)."""
    global _ext
    from devices.npu_sim import ext as extension

    _ext = extension.load()
    if torch_compat.backend_plugin(BACKEND_NAME) is None:
        dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True, devices=["npu"])
