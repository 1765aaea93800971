"""Every trainer rank a sender: S senders to N rollouts as S one-to-many *lanes*, received concurrently.

With ``multi_sender=True`` (verl's name for the topology option), ``build_topology`` gives trainer ranks
``0..S-1`` the sender role and the rollouts ranks ``S..S+N-1`` (``num_senders=S``, as verl's
``NCCLCheckpointEngine`` numbers them). The group is then **one lane per sender**: lane ``s`` is sender ``s``
plus every rollout, a single-sender group of the engine's own transport (its own communicator, keys
``.../s<s>`` in the one rendezvous store trainer rank 0 hosts). Lanes run concurrently, so the update's
bandwidth adds up over the senders' links (each sender's link carries only its shards, once per rollout).

Why lanes and not one group with the source rotating per bucket: in one group every collective involves
every member, so a bucket broadcast from sender ``s`` also lands on the other senders (their links carry the
whole model again, and their memory a receive buffer), and the collectives of one communicator are ordered,
so the senders take turns instead of sending at once; the lanes' broadcasts are independent. Measured with
``hal.apps.benchmarks.bench_senders`` (32 MiB bf16 to 2 rollouts, trainer links R = 100 Mbit/s, rollout links
4R, gloo, one run): lanes 2.00x / 3.92x the one-sender throughput with 2 / 4 senders and 0.88 R with rollout
links of R; one group rotating the source per bucket 1.21x / 0.80x and 0.38 R.

What a sharded trainer calls: on trainer rank ``r`` of ``T``, an engine built with ``multi_sender=True``
(``is_master`` on rank 0), verl's ``prepare`` / ``build_topology(T, N, metadata)`` /
``init_process_group(**entries)``, then ``send_weights(ckpt.local_parts(fsdp_module.state_dict().items(), r,
dtype=torch.bfloat16), global_steps)`` on every trainer rank at once (no gathers); the rollouts call
``receive_weights`` as for one sender.

Sender side (:func:`send_parts`): a sender publishes ``(name, value)`` pairs, ``value`` a whole tensor, a
:class:`ckpt.shards.RowShard` or an FSDP2 ``DTensor`` (:func:`ckpt.shards.as_row_shard`); a row part goes on
the wire with its row range and the full shape (:class:`ckpt.wire.TensorEntry`).

Rollout side (:func:`receive_parts`): it receives every lane at once and **yields full tensors**, each once
all its rows have arrived (whole tensors as their lane delivers them), so a consumer sees the same stream as
from one sender: every name once, in completion order (each sender's order is kept among its own tensors).
Given a ``placement``, a part is received straight into rows ``[row_start, row_start + rows)`` of
``placement.target(name, dtype, full_shape)`` and that full tensor is yielded; without one (or where the
placement gives nothing usable) parts are assembled in an engine-owned tensor of the full shape, yielded
once complete and dropped after the consumer advances.

Guarantees, as for one sender:

* **step**: every lane is checked against ``global_steps``; asked for ``None``, every sender must have sent the
  same step. A sender with another step is a :class:`VersionMismatchError` naming its trainer rank, raised
  before anything is yielded (each lane holds its first tensor until every lane's step is known);
* **all or nothing**: the stream ends normally only when every lane ended and every tensor is complete; a
  lane that failed (a dead sender, a timeout, an abort) fails the update with the error of that lane, naming
  the trainer rank, after the other lanes were received and discarded (their groups stay in step);
* **memory**: two receive buffers per lane (bucket-sized, as one sender's), plus, without a placement, the
  full-size assembly tensors of the row-sharded tensors whose parts are still arriving;
* **timeouts**: every lane's waits are bounded by the engine's ``timeout``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, AsyncIterator, Callable, Iterable, Sequence

import torch

from ckpt.base import NamedTensor, ReceivePlacement, named_tensors
from ckpt.errors import TransferError, VersionMismatchError
from ckpt.shards import RowShard, as_row_shard


def published(weights: Iterable[tuple[str, Any]]) -> tuple[Iterable[NamedTensor], dict[str, tuple[list[int], int]]]:
    """A sender's ``weights`` as ``(name, tensor)`` pairs for the wire, and the row parts among them.

    Returns:
        ``(pairs, parts)``: ``pairs`` yields each whole tensor or each part's local rows (a list when
        ``weights`` is a collection, so zero-copy sends of runs stay possible, else a generator);
        ``parts`` maps a part's name to ``(full_shape, row_start)``, filled as ``pairs`` is consumed.

    Raises (while consumed):
        CheckpointConfigError: a value that is not a tensor, a :class:`RowShard` or a FSDP2 ``DTensor``.
    """
    parts: dict[str, tuple[list[int], int]] = {}

    def convert():
        for name, value in named_tensors(weights, accepted=()):
            value = as_row_shard(name, value)
            if value is None:
                continue
            if isinstance(value, RowShard):
                parts[name] = (list(value.full_shape), value.row_start)
                value = value.local
            yield name, value

    if isinstance(weights, (list, tuple, dict)) or type(weights).__name__ == "dict_items":
        return list(convert()), parts
    return convert(), parts


@dataclasses.dataclass
class _Pending:
    """A row-sharded tensor whose parts are arriving: where they go and how many rows came."""

    full: torch.Tensor
    rows: int = 0


class PartAssembler:
    """Puts received parts into full tensors; see the module docstring.

    Args:
        placement: the consumer's :class:`ReceivePlacement`, or ``None``.
        device: where assembly tensors are allocated.
    """

    def __init__(self, placement: ReceivePlacement | None, device: torch.device) -> None:
        self.placement, self.device = placement, device
        self.pending: dict[str, _Pending] = {}
        self.done: set[str] = set()

    def _full(self, name: str, dtype: torch.dtype, full_shape: list[int]) -> torch.Tensor:
        dest = self.placement.target(name, dtype, torch.Size(full_shape)) if self.placement is not None else None
        if (isinstance(dest, torch.Tensor) and dest.dtype == dtype and list(dest.shape) == list(full_shape)
                and dest.is_contiguous()):
            return dest
        return torch.empty(full_shape, dtype=dtype, device=self.device)

    def add(self, name: str, tensor: torch.Tensor, part: tuple[list[int], int] | None) -> NamedTensor | None:
        """Take one received item; returns the ``(name, full tensor)`` it completes, if any.

        ``tensor`` may be a view into a lane's buffer (copied into place here) or the placed rows themselves.

        Raises:
            TransferError: a tensor arrived twice, or parts that overlap or overrun its rows.
        """
        if part is None:
            if name in self.done or name in self.pending:
                raise TransferError(f"tensor {name!r} was sent by more than one sender")
            self.done.add(name)
            return name, tensor
        full_shape, row_start = part
        rows = tensor.shape[0] if tensor.dim() else 1
        if name in self.done:
            if rows == 0:
                return None  # another sender's empty shard of a tensor already complete
            raise TransferError(f"rows [{row_start}, {row_start + rows}) of {name!r} arrived after the tensor was "
                                "complete (two senders hold the same rows)")
        pending = self.pending.get(name)
        if pending is None:
            pending = self.pending[name] = _Pending(self._full(name, tensor.dtype, full_shape))
        if list(pending.full.shape) != list(full_shape) or pending.full.dtype != tensor.dtype:
            raise TransferError(f"parts of {name!r} disagree: full shape {list(pending.full.shape)} "
                                f"{pending.full.dtype} and {full_shape} {tensor.dtype}")
        if rows:
            dest = pending.full[row_start:row_start + rows]
            if dest.data_ptr() != tensor.data_ptr():
                dest.copy_(tensor)
        pending.rows += rows
        if pending.rows > full_shape[0]:
            raise TransferError(f"{name!r} got {pending.rows} rows of {full_shape[0]}: senders' parts overlap")
        if pending.rows < full_shape[0]:
            return None
        del self.pending[name]
        self.done.add(name)
        return name, pending.full

    def missing(self) -> list[str]:
        """What is incomplete after every lane ended: ``"name (k of n rows)"`` per tensor."""
        return [f"{n} ({p.rows} of {p.full.shape[0]} rows)" for n, p in self.pending.items()]


class PartPlacement:
    """A lane's placement: for a row part, rows ``[row_start, row_start + rows)`` of the consumer's full
    tensor (``placement.target(name, dtype, full_shape)``), so the lane receives a part in place."""

    def __init__(self, placement: ReceivePlacement) -> None:
        self.placement = placement

    def target(self, name: str, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor | None:
        return self.placement.target(name, dtype, shape)

    def part_target(self, name: str, dtype: torch.dtype, shape: Sequence[int], full_shape: Sequence[int],
                    row_start: int) -> torch.Tensor | None:
        """The rows of the consumer's full tensor this part fills (a contiguous dim-0 slice), or ``None``."""
        full = self.placement.target(name, dtype, torch.Size(full_shape))
        if not isinstance(full, torch.Tensor) or list(full.shape) != list(full_shape) or not full.is_contiguous():
            return None
        return full[row_start:row_start + shape[0]]


def named_error(exc: BaseException, sender: int) -> BaseException:
    """``exc`` (a lane's failure) again, its message naming the trainer rank ``sender`` (same class when it
    can be built from a message, else :class:`TransferError`)."""
    message = f"sender trainer rank {sender}: {exc}"
    if isinstance(exc, VersionMismatchError):
        return VersionMismatchError(exc.expected, exc.received, f"the lane of sender trainer rank {sender}")
    try:
        return type(exc)(message)
    except Exception:  # noqa: BLE001 - a class that takes other arguments
        return TransferError(message)


async def receive_parts(lanes: Sequence[Any], global_steps: int | None, placement: ReceivePlacement | None,
                        device: torch.device, parts_of: Callable[[Any, str], tuple[list[int], int] | None],
                        on_step: Callable[[int | None], None]) -> AsyncIterator[NamedTensor]:
    """Receive one update from every lane at once and yield full tensors (see the module docstring).

    Args:
        lanes: the lane engines, lane ``s`` from trainer rank ``s``; each has ``receive_weights(global_steps,
            placement=...)`` and ``received_global_steps``.
        global_steps: the step asked for, or ``None``.
        placement: the consumer's placement, or ``None``.
        device: where assembly tensors go.
        parts_of: ``parts_of(lane, name)`` -> ``(full_shape, row_start)`` of the item the lane just yielded
            when it is a row part, else ``None``.
        on_step: called with the agreed step once every lane's step is known (before the first yield).

    Raises:
        VersionMismatchError: a sender sent another step than asked, or than the other senders.
        TransferError, TransferTimeoutError: a lane failed (names the trainer rank), or the update ended
            with tensors incomplete.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    assembler = PartAssembler(placement, device)
    lane_placement = PartPlacement(placement) if placement is not None else None
    steps: dict[int, int | None] = {}
    known = asyncio.Event()
    state = {"discard": False}

    def learned(s: int, step: int | None) -> None:
        if s not in steps:
            steps[s] = step
            if len(steps) == len(lanes):
                known.set()

    async def run(s: int, lane: Any) -> None:
        try:
            async for name, tensor in lane.receive_weights(global_steps, placement=lane_placement):
                learned(s, lane.received_global_steps)
                await known.wait()
                if state["discard"]:
                    continue
                done = assembler.add(name, tensor, parts_of(lane, name))
                if done is not None:
                    ack = loop.create_future()
                    await queue.put(("item", s, done, ack))
                    await ack
            learned(s, lane.received_global_steps)
            await queue.put(("end", s, None, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer's side
            learned(s, None)
            await queue.put(("error", s, exc, None))

    tasks = [asyncio.ensure_future(run(s, lane)) for s, lane in enumerate(lanes)]
    failure: BaseException | None = None
    running = len(lanes)

    async def settle() -> None:
        nonlocal running, failure
        while running:
            kind, s, payload, ack = await queue.get()
            if kind == "item":
                ack.set_result(None)
            else:
                running -= 1
                if kind == "error" and failure is None:
                    failure = named_error(payload, s)

    try:
        await known.wait()
        agreed = {st for st in steps.values() if st is not None}
        if len(agreed) > 1:
            state["discard"] = True
            by_rank = ", ".join(f"trainer rank {s}: step {steps[s]}" for s in sorted(steps))
            first, other = sorted(agreed)[:2]
            failure = VersionMismatchError(first, other, f"a multi-sender update (the senders disagree: {by_rank}; "
                                                         "nothing is applied)")
        else:
            on_step(agreed.pop() if agreed else None)
        while running:
            kind, s, payload, ack = await queue.get()
            if kind == "item":
                if failure is None and not state["discard"]:
                    try:
                        yield payload
                    finally:
                        ack.set_result(None)
                else:
                    ack.set_result(None)
            else:
                running -= 1
                if kind == "error" and failure is None:
                    state["discard"] = True
                    failure = named_error(payload, s)
        if failure is None and assembler.missing():
            failure = TransferError(f"the update ended incomplete: {', '.join(assembler.missing()[:8])}")
    except GeneratorExit:  # the consumer stopped early: receive and discard the rest (the lanes stay in step)
        state["discard"] = True
        await settle()
        raise
    except BaseException:  # cancelled: stop the lanes (their groups are then out of step and rebuilt)
        for t in tasks:
            t.cancel()
        raise
    if failure is not None:
        raise failure


async def send_parts(lane: Any, weights: Iterable[tuple[str, Any]], global_steps: int | None) -> None:
    """Publish one sender's ``weights`` (whole tensors, :class:`RowShard` or FSDP2 ``DTensor`` values) on its
    lane (its ``send_row_parts(pairs, global_steps, parts)``)."""
    pairs, parts = published(weights)
    await lane.send_row_parts(pairs, global_steps, parts)
