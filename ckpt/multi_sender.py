"""Every trainer rank a sender: S senders to N rollouts as S one-to-many *lanes*, received concurrently.

With ``multi_sender=True``, ``build_topology`` gives trainer ranks ``0..S-1`` the sender role and the
rollouts ranks ``S..S+N-1`` (``num_senders=S``, as verl numbers them). Lane ``s`` is sender ``s`` plus every
rollout, a single-sender group of the engine's own transport (keys ``.../s<s>`` in the one store trainer rank
0 hosts); lanes run concurrently, so bandwidth adds up over the senders' links.

A sender publishes whole tensors, :class:`ckpt.shards.RowShard` or FSDP2 ``DTensor`` values (e.g.
``ckpt.local_parts(fsdp_module.state_dict().items(), r)``, no gathers); a row part travels with its row range
and full shape. A rollout receives every lane at once and yields full tensors, each name once, when all its
rows arrived (into ``placement``'s full tensor where given, else an engine-owned one).

As for one sender: every lane is checked against ``global_steps`` (and the senders must agree) before
anything is yielded; the update ends normally only when every lane ended and every tensor is complete, else
it fails with the failing lane's error naming its trainer rank; memory is two buffers per lane plus the
assembly tensors still filling; every wait is bounded by the engine's ``timeout``."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, AsyncIterator, Callable, Iterable, Sequence

import torch

from ckpt.base import NamedTensor, ReceivePlacement, named_tensors
from ckpt.errors import TransferError, VersionMismatchError
from ckpt.shards import RowShard, as_row_shard


def published(weights: Iterable[tuple[str, Any]]) -> tuple[Iterable[NamedTensor], dict[str, tuple[list[int], int]]]:
    """Return ``(pairs, parts)``: the wire's ``(name, tensor)`` pairs and ``{name: (full_shape, row_start)}``.

    ``parts`` fills as ``pairs`` is consumed; ``pairs`` is a list when ``weights`` is a collection."""
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

    full: torch.Tensor
    rows: int = 0


class PartAssembler:
    """Puts received parts into full tensors (the consumer's ``placement`` where usable, else on ``device``)."""

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
        """Take one received item; return the ``(name, full tensor)`` it completes, if any.

        Raises :class:`TransferError` when a tensor arrives twice or parts overlap."""
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
        """Return what is incomplete after every lane ended: ``"name (k of n rows)"`` per tensor."""
        return [f"{n} ({p.rows} of {p.full.shape[0]} rows)" for n, p in self.pending.items()]


class PartPlacement:
    """A lane's placement: a row part goes straight into its rows of the consumer's full tensor."""

    def __init__(self, placement: ReceivePlacement) -> None:
        self.placement = placement

    def target(self, name: str, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor | None:
        return self.placement.target(name, dtype, shape)

    def part_target(self, name: str, dtype: torch.dtype, shape: Sequence[int], full_shape: Sequence[int],
                    row_start: int) -> torch.Tensor | None:
        full = self.placement.target(name, dtype, torch.Size(full_shape))
        if not isinstance(full, torch.Tensor) or list(full.shape) != list(full_shape) or not full.is_contiguous():
            return None
        return full[row_start:row_start + shape[0]]


def named_error(exc: BaseException, sender: int) -> BaseException:
    """Return ``exc`` again with its message naming trainer rank ``sender`` (else a :class:`TransferError`)."""
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
    """Receive one update from every lane at once and yield full tensors (see the module overview).

    ``parts_of(lane, name)`` gives ``(full_shape, row_start)`` of the item a lane just yielded, or ``None``;
    ``on_step`` gets the agreed step before the first yield."""
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


async def send_parts(lane: Any, weights: Iterable[tuple[str, Any]], global_steps: int | None,
                     check: Any = False) -> None:
    """Publish one sender's ``weights`` on its lane (``check``: see ``send_weights``)."""
    pairs, parts = published(weights)
    await lane.send_row_parts(pairs, global_steps, parts, check)
