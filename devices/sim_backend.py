"""The ``hccl`` collective backend of the simulated NPU: gloo underneath, on the npu tensors' own bytes.

Registered as torch_npu registers HCCL: ``Backend.register_backend("hccl", ..., extended_api=True,
devices=["npu"])`` (a list: torch 2.13 splits a string into characters). The creator returns
:class:`SimHcclGroup`, a Python ``torch.distributed.ProcessGroup`` subclass (the pattern of PyTorch's
``test_c10d_pypg`` and ``multi_threaded_pg``) wrapping a ``ProcessGroupGloo``. npu memory is host memory,
so each npu tensor is handed to gloo as a cpu tensor over the same bytes (no staging copy).

Every collective runs to completion before it returns, or raises ``hal.DistributedTimeoutError`` once the
group's timeout passes (a missing or dead peer); the returned work object is already complete. Calls must be made in the same order on every rank, as with
HCCL. Like NCCL ("Duplicate GPU detected") and HCCL, a communicator refuses two ranks on one device: the
first collective of a group exchanges each rank's device (host, and the physical id behind
``ASCEND_RT_VISIBLE_DEVICES``; the host is ``$HAL_SIM_HOST`` where set) and every rank raises
``torch.distributed.DistBackendError`` naming both ranks if two share one, so code that forgets to bind
each rank's device fails on any machine.
Covered: broadcast, allreduce (SUM/PRODUCT/MIN/MAX, and AVG as SUM then divide; gloo has no AVG),
allreduce_coalesced, allgather, all_gather_single (``all_gather_into_tensor``, ``_allgather_base``),
reduce_scatter, reduce_scatter_single (``reduce_scatter_tensor``, ``_reduce_scatter_base``), barrier,
send/recv, all_to_all_single; DDP and FSDP2 (``fully_shard``, ``DTensor.full_tensor()``) run on it in eager
mode.

Collectives that C++ starts (functional collectives: ``DTensor.full_tensor()``, redistribution; DDP's
reducer) reach a Python process group only through the names torch's ``PyProcessGroup`` trampoline
forwards (``torch/csrc/distributed/c10d/PyProcessGroup.hpp``): allgather, all_gather_single_coalesced,
allreduce(_coalesced), all_to_all_single, barrier, broadcast, reduce_scatter(_single_coalesced), send,
recv; all of them are defined here. Undefined names (gather, scatter, reduce) reach the wrapped gloo
directly, on the npu tensors' bytes and past this class's checks. Started from C++, such a call also holds
the caller's GIL into gloo: gloo's worker thread drops a finished op's tensors while holding its queue lock,
dropping a tensor that Python has seen takes the GIL (PyTorch keeps a tensor's Python object alive while
C++ holds it), so a caller that enqueues with the GIL held can deadlock with that thread. Here every gloo
call goes through its Python binding, which releases the GIL first.
"""

from __future__ import annotations

import datetime
import os
import socket
import zlib
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from devices import torch_compat
from devices.errors import DistributedTimeoutError

BACKEND_NAME = "hccl"
_ext = None


class SimWork(torch_compat.Work):
    """A completed collective: ``wait`` returns ``True`` at once; ``get_future`` holds the output tensors."""

    def __init__(self, result: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self._result = list(result)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def result(self) -> list[torch.Tensor]:
        return self._result

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self._result)
        return fut


def _op(opts: Any) -> dist.ReduceOp:
    """The reduce op of an options object, SUM when none was passed."""
    return dist.ReduceOp.SUM if opts is None else opts.reduceOp


def _host(t: torch.Tensor) -> torch.Tensor:
    """A contiguous cpu tensor over ``t``'s bytes (a copy only when ``t`` is not contiguous)."""
    if t.device.type not in ("npu", "cpu"):
        raise ValueError(f"the npu-sim hccl backend takes npu or cpu tensors, got one on {t.device}")
    alias = _ext.host_alias(t)
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
        timeout: bound on the rendezvous and on every collective (timedelta).
    """

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self._rank, self._size, self._timeout = rank, size, timeout
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._device_checked = False
        # C++ callers look a backend up per device (init_process_group with device_id does); gloo answers
        # for host tensors, and for npu ones it rejects what the C++-only paths would hand it.
        for device in ("cpu", "npu"):
            torch_compat.register_group_backend(self, torch.device(device), self._gloo)

    # -- identity
    def getBackendName(self) -> str:  # noqa: N802 - C++ name, overridden through pybind11
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    # -- plumbing
    def _run(self, what: str, start: Callable[[], Any]) -> None:
        """Start a gloo op and wait for it within the timeout.

        Raises:
            DistributedTimeoutError: the op did not complete within the group's timeout, or a peer died
                (gloo reports both as errors naming a timeout or a closed connection).
        """
        try:
            work = start()
            ok = work.wait(self._timeout)
        except Exception as exc:
            text = str(exc).lower()
            if isinstance(exc, TimeoutError) or any(k in text for k in ("timed out", "timeout", "connection", "closed")):
                raise DistributedTimeoutError(
                    f"npu-sim hccl {what} on rank {self._rank}/{self._size} failed within "
                    f"{self._timeout.total_seconds():g} s, a peer is missing or dead: {exc}") from exc
            raise
        if ok is False:
            raise DistributedTimeoutError(f"npu-sim hccl {what} on rank {self._rank}/{self._size} did not "
                                          f"complete within {self._timeout.total_seconds():g} s")

    def _reduce_op(self, op: Any) -> tuple[dist.ReduceOp, bool]:
        """(the gloo op, whether to divide by the group size afterwards) for a ReduceOp or RedOpType."""
        kind = getattr(op, "op", op)
        if kind == dist.ReduceOp.AVG:
            return dist.ReduceOp.SUM, True
        for ok in (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX):
            if kind == ok:
                return ok, False
        raise ValueError(f"npu-sim hccl supports SUM, AVG, PRODUCT, MIN, MAX; got {kind}")

    def _check_devices(self, tensors: Sequence[torch.Tensor]) -> None:
        """On the group's first collective: refuse two ranks on one device, as NCCL and HCCL do.

        The device is that of the first npu tensor, else the current device. Every rank takes part (the
        first collective is the same call on every rank) and every rank raises on a clash.

        Raises:
            torch.distributed.DistBackendError: two ranks of this group are on one device of one host.
        """
        if self._device_checked:
            return
        self._device_checked = True
        npu = next((t for t in tensors if t.device.type == "npu"), None)
        index = npu.device.index if npu is not None and npu.device.index is not None else _ext.current_device()
        mine = torch.tensor([_host_id(), physical_device(index), index], dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(self._size)]
        self._run("device check", lambda: self._gloo.allgather([everyone], [mine]))
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

    # -- collectives
    def broadcast(self, tensors: list[torch.Tensor], opts=None) -> SimWork:
        self._check_devices(tensors)
        hosts = [_host(t) for t in tensors]
        o = dist.BroadcastOptions()
        o.rootRank, o.rootTensor = (opts.rootRank, opts.rootTensor) if opts is not None else (0, 0)
        o.timeout = self._timeout
        self._run("broadcast", lambda: self._gloo.broadcast(hosts, o))
        for t, h in zip(tensors, hosts):
            _write_back(t, h)
        return SimWork(tensors)

    def allreduce(self, tensors: list[torch.Tensor], opts=None) -> SimWork:
        self._check_devices(tensors)
        op, divide = self._reduce_op(_op(opts))
        hosts = [_host(t) for t in tensors]
        o = dist.AllreduceOptions()
        o.reduceOp, o.timeout = op, self._timeout
        self._run("allreduce", lambda: self._gloo.allreduce(hosts, o))
        for t, h in zip(tensors, hosts):
            if divide:
                h.div_(self._size)
            _write_back(t, h)
        return SimWork(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts=None) -> SimWork:
        o = dist.AllreduceOptions()
        o.reduceOp = _op(opts)
        for t in tensors:
            self.allreduce([t], o)
        return SimWork(tensors)

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts=None) -> SimWork:
        self._check_devices(inputs)
        host_outs = [[_host(t) for t in outs] for outs in output_lists]
        host_ins = [_host(t) for t in inputs]
        self._run("allgather", lambda: self._gloo.allgather(host_outs, host_ins))
        for outs, houts in zip(output_lists, host_outs):
            for t, h in zip(outs, houts):
                _write_back(t, h)
        return SimWork([t for outs in output_lists for t in outs])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts=None) -> SimWork:
        """``output`` (``size * input.numel()`` elements, rank-major) gets every rank's ``input``."""
        if output.numel() != input.numel() * self._size:
            raise ValueError(f"all_gather_single: output has {output.numel()} elements, expected "
                             f"{input.numel()} x {self._size}")
        chunks = list(output.reshape(self._size, -1).unbind(0)) if output.is_contiguous() else None
        if chunks is None:
            flat = torch.empty(output.numel(), dtype=output.dtype, device=output.device)
            chunks = list(flat.view(self._size, -1).unbind(0))
        self.allgather([chunks], [input.reshape(-1)])
        if not output.is_contiguous():
            output.copy_(flat.view(output.shape))
        return SimWork([output])

    _allgather_base = all_gather_single
    all_gather_into_tensor = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts=None) -> SimWork:
        """:meth:`all_gather_single` for each ``(output, input)`` pair, in order. The C++ side of a Python
        process group calls this one (functional collectives, so ``DTensor.full_tensor()`` and DTensor
        redistribution); without it C++ would run the wrapped gloo on the npu tensors itself (see the
        module doc)."""
        for out, inp in zip(outputs, inputs):
            self.all_gather_single(out, inp)
        return SimWork(outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                       opts=None) -> SimWork:
        o = dist.AllreduceOptions()
        o.reduceOp = _op(opts)
        for out, inputs in zip(outputs, input_lists):
            stacked = torch.stack([t.reshape(-1) for t in inputs])
            self.allreduce([stacked], o)
            out.copy_(stacked[self._rank].view(out.shape))
        return SimWork(outputs)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts=None) -> SimWork:
        """``output`` gets this rank's chunk (rank-major) of the reduction of every rank's ``input``."""
        if input.numel() != output.numel() * self._size:
            raise ValueError(f"reduce_scatter_single: input has {input.numel()} elements, expected "
                             f"{output.numel()} x {self._size}")
        o = dist.AllreduceOptions()
        o.reduceOp = _op(opts)
        reduced = input.reshape(-1).clone()
        self.allreduce([reduced], o)
        output.copy_(reduced.view(self._size, -1)[self._rank].view(output.shape))
        return SimWork([output])

    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts=None) -> SimWork:
        """:meth:`reduce_scatter_single` for each ``(output, input)`` pair, in order (the C++ entry of
        functional reduce-scatters, as for :meth:`all_gather_single_coalesced`)."""
        for out, inp in zip(outputs, inputs):
            self.reduce_scatter_single(out, inp, opts)
        return SimWork(outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int],
                          input_split_sizes: Sequence[int], opts=None) -> SimWork:
        """Rank ``r`` sends the ``r``-th slice (along dim 0) of ``input`` to every rank and receives theirs
        into ``output``; empty split lists mean equal slices (``torch.distributed.all_to_all_single``)."""
        self._check_devices([input])
        host_out, host_in = _host(output), _host(input)
        o = dist.AllToAllOptions()
        o.timeout = self._timeout
        self._run("all_to_all_single", lambda: self._gloo.alltoall_base(
            host_out, host_in, list(output_split_sizes), list(input_split_sizes), o))
        _write_back(output, host_out)
        return SimWork([output])

    alltoall_base = all_to_all_single

    def barrier(self, opts=None) -> SimWork:
        self._check_devices(())
        o = dist.BarrierOptions()
        o.timeout = self._timeout
        self._run("barrier", lambda: self._gloo.barrier(o))
        return SimWork([])

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> SimWork:
        hosts = [_host(t) for t in tensors]
        self._run(f"send to {dst}", lambda: self._gloo.send(hosts, dst, tag))
        return SimWork(tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> SimWork:
        hosts = [_host(t) for t in tensors]
        self._run(f"recv from {src}", lambda: self._gloo.recv(hosts, src, tag))
        for t, h in zip(tensors, hosts):
            _write_back(t, h)
        return SimWork(tensors)

    def shutdown(self) -> None:
        """Release the gloo communicator."""
        gloo, self._gloo = self._gloo, None
        if gloo is not None and hasattr(gloo, "shutdown"):
            gloo.shutdown()

    abort = shutdown


def create(opts: Any, backend_options: Any = None) -> SimHcclGroup:
    """The ``extended_api`` creator: ``opts`` is a ``_DistributedBackendOptions`` (store, group_rank,
    group_size, timeout), as ``init_process_group``/``new_group`` and ``hal.new_group_from_store`` pass."""
    return SimHcclGroup(opts.store, opts.group_rank, opts.group_size, opts.timeout)


def register() -> None:
    """Register ``hccl`` with torch.distributed once per process (a second registration would raise)."""
    global _ext
    from devices import sim_ext

    _ext = sim_ext.load()
    if torch_compat.backend_plugin(BACKEND_NAME) is None:
        dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True, devices=["npu"])
