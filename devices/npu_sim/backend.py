"""The ``hccl`` collective backend of the simulated NPU: gloo underneath, on the npu tensors' own bytes.

Registered as torch_npu registers HCCL (``register_backend("hccl", ..., extended_api=True, devices=["npu"])``);
:class:`SimHcclGroup` is a Python ``ProcessGroup`` wrapping a ``ProcessGroupGloo``, and hands each npu tensor
to gloo as a cpu tensor over the same bytes.

Collectives complete asynchronously, as on HCCL's stream, so a missing ``wait`` shows on the sim: a call
queues the operation and returns a :class:`SimWork`; each group runs its queue in issue order (ranks must
issue alike) only when needed: ``work.wait()``, ``work.get_future()``, ``torch.npu.synchronize(device)`` or
:meth:`SimHcclGroup.shutdown`. Until then input is unread and output unwritten. A run past the group's
timeout raises ``hal.DistributedTimeoutError`` from ``wait``, and the operations queued behind it fail unrun.

As NCCL and HCCL, a communicator refuses two ranks on one device: the first collective exchanges each rank's
(host, physical device) and raises ``DistBackendError`` on a clash. DDP and FSDP2 run on it in eager mode.
Collectives C++ starts reach this class only through the names torch's ``PyProcessGroup`` trampoline
forwards (all defined here); gather, scatter and reduce from C++ go straight to gloo. Every gloo call goes
through its Python binding, which releases the GIL (gloo's worker thread may need it).
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

# The live groups of this process by creation number (what synchronize runs, oldest first).
_groups: weakref.WeakValueDictionary[int, SimHcclGroup] = weakref.WeakValueDictionary()
_group_ids = itertools.count()


class SimWork(torch_compat.Work):
    """One issued collective of a :class:`SimHcclGroup`: queued until needed (see the module doc).

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
        """Run this collective (and those issued before it on the group) unless done; return ``True``."""
        if not self._done:
            self._group.run_until(self)
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """Return whether the collective has run."""
        return self._done

    def is_success(self) -> bool:
        """Return whether the collective has run without error."""
        return self._done and self._error is None

    def exception(self) -> BaseException | None:
        """Return what the collective raised when it ran (``None``: not run yet, or no error)."""
        return self._error

    def result(self) -> list[torch.Tensor]:
        """Return the output tensors (written once the collective has run)."""
        return self._result

    def get_future(self) -> torch.futures.Future:
        """Run the collective now and return a completed future of its output tensors (or of its error)."""
        fut: torch.futures.Future = torch.futures.Future()
        try:
            self.wait()
        except Exception as exc:  # noqa: BLE001 - handed to the future's waiter
            fut.set_exception(without_frames(exc))
        else:
            fut.set_result(self._result)
        return fut


def without_frames(exc: BaseException) -> BaseException:
    """Return ``exc`` with the tracebacks of it and every exception it chains dropped.

    For a ``torch.futures.Future``: a traceback would close a cycle (future, group, gloo sockets) the garbage
    collector cannot see.
    """
    seen, e = set(), exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return exc


def synchronize(index: int) -> None:
    """Run the queued collectives of every live group on npu ``index`` (``torch.npu.synchronize`` on the sim)."""
    for _, group in sorted(_groups.items()):
        if group.device_index == index:
            group.flush()


def _op(opts: Any) -> dist.ReduceOp:
    """Return the reduce op of an options object, SUM when none was passed."""
    return dist.ReduceOp.SUM if opts is None else opts.reduceOp


def _check_tensors(tensors: Sequence[torch.Tensor]) -> None:
    """Raise ``ValueError`` naming the device of a tensor that is neither on npu nor on cpu."""
    for t in tensors:
        if t.device.type not in ("npu", "cpu"):
            raise ValueError(f"the npu-sim hccl backend takes npu or cpu tensors, got one on {t.device}")


def _host(t: torch.Tensor) -> torch.Tensor:
    """Return a new contiguous cpu tensor over ``t``'s bytes (a copy only when ``t`` is not contiguous)."""
    _check_tensors((t,))
    alias = t.detach() if t.device.type == "cpu" else _ext.host_alias(t)
    return alias if alias.is_contiguous() else alias.contiguous()


def physical_device(index: int) -> int:
    """Return the physical id of device ``index``: its ``ASCEND_RT_VISIBLE_DEVICES`` entry, else ``index``."""
    visible = [v.strip() for v in os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if index < len(visible) and visible[index].lstrip("-").isdigit():
        return int(visible[index])
    return index


# Names the simulated host of a process (default: the host name): simulated nodes on one machine differ.
SIM_HOST_ENV = "HAL_SIM_HOST"


def _host_id() -> int:
    """Return a 31-bit id of this (simulated) host: CRC-32 of ``$HAL_SIM_HOST``, else of the host name."""
    return zlib.crc32((os.environ.get(SIM_HOST_ENV) or socket.gethostname()).encode()) & 0x7FFFFFFF


def _write_back(dst: torch.Tensor, host: torch.Tensor) -> None:
    """Copy ``host`` into ``dst`` unless it already aliases ``dst``'s bytes."""
    if host.data_ptr() != dst.data_ptr() or host.stride() != dst.stride():
        dst.copy_(host)


class SimHcclGroup(dist.ProcessGroup):
    """A ``hccl`` process group of the npu-sim kind (see the module doc); ``timeout`` bounds every collective."""

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
        """Queue ``run`` (the whole collective) and return its work; ``check``: may carry the device check."""
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
        """Run the queued operations in issue order until ``work`` has run (one thread at a time)."""
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
        """Run every queued operation now (what synchronizing the group's device does)."""
        try:
            last = self._queue[-1]
        except IndexError:
            return
        last.wait()

    # -- plumbing
    def _run(self, what: str, start: Callable[[], Any], tensors: Sequence[torch.Tensor] = ()) -> None:
        """Start a gloo op on ``tensors`` and wait, within the timeout, for it and then for gloo to let go of them.

        The second wait keeps the group destructible: gloo's worker frees an op's tensors under its queue lock,
        which may need the GIL, and ``ProcessGroupGloo``'s destructor takes that lock with the GIL held.
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
        """Sleep until each of ``tensors`` is back to ``held`` C++ references, at most the timeout; return whether."""
        deadline = time.monotonic() + self._timeout.total_seconds()
        pause = 5e-5
        while any(torch_compat.use_count(t) > n for t, n in zip(tensors, held)):
            if time.monotonic() > deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, 5e-3)
        return True

    def _reduce_op(self, op: Any) -> tuple[dist.ReduceOp, bool]:
        """Return the gloo op and whether to divide by the group size afterwards (AVG)."""
        kind = getattr(op, "op", op)
        if kind == dist.ReduceOp.AVG:
            return dist.ReduceOp.SUM, True
        for ok in (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX):
            if kind == ok:
                return ok, False
        raise ValueError(f"npu-sim hccl supports SUM, AVG, PRODUCT, MIN, MAX; got {kind}")

    def _check_devices(self, index: int) -> None:
        """On the group's first collective, raise ``DistBackendError`` on every rank if two share one device."""
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
                    f"(hal.set_device(), or torch.npu.set_device(LOCAL_RANK))")
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
        """Gather every rank's ``input`` into ``output`` (``size * input.numel()`` elements, rank-major)."""
        self._gather_sizes(output, input)
        _check_tensors([output])
        return self._issue("all_gather_single", [input], lambda: self._all_gather_single_now(output, input),
                           [output])

    _allgather_base = all_gather_single
    all_gather_into_tensor = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts=None) -> SimWork:
        """Run :meth:`all_gather_single` for each ``(output, input)`` pair (C++'s functional collectives call it)."""
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
        """Reduce every rank's ``input`` and give this rank its chunk (rank-major) in ``output``."""
        self._scatter_sizes(output, input)
        _check_tensors([output])
        op, divide = self._reduce_op(_op(opts))
        return self._issue("reduce_scatter_single", [input],
                           lambda: self._reduce_scatter_single_now(output, input, op, divide), [output])

    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts=None) -> SimWork:
        """Run :meth:`reduce_scatter_single` for each ``(output, input)`` pair (C++ functional collectives call it)."""
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
        """Send the ``r``-th dim-0 slice of ``input`` to rank ``r`` and receive theirs (empty splits: equal slices)."""
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
        """Reduce every rank's ``tensors`` into rank ``opts.rootRank``'s (``torch.distributed.reduce``)."""
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
        """Gather every rank's ``inputs[0]`` into ``output_lists[0]`` on rank ``opts.rootRank``."""
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
        """Scatter rank ``opts.rootRank``'s ``input_lists[0]`` into every rank's ``outputs[0]``."""
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
        """Run the queued collectives, then release the gloo communicator (also when one times out)."""
        try:
            self.flush()
        finally:
            self._release()

    def abort(self) -> None:
        """Drop the queued collectives (their ``wait`` raises) and release the gloo communicator."""
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
    """Create the group from a ``_DistributedBackendOptions`` (the ``extended_api`` creator)."""
    return SimHcclGroup(opts.store, opts.group_rank, opts.group_size, opts.timeout)


def register() -> None:
    """Register ``hccl`` with torch.distributed once per process (a second registration would raise)."""
    global _ext
    from devices.npu_sim import ext as extension

    _ext = extension.load()
    if torch_compat.backend_plugin(BACKEND_NAME) is None:
        dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True, devices=["npu"])
