"""Packing named tensors into fixed-size byte buckets, and the per-message metadata that describes them.

A transfer is a sequence of *messages*. Each message is one :class:`ckpt.wire.WireMessage` (its encoding is
:mod:`ckpt.wire`'s) followed by one or more data *segments*:

* a **bucket** message: ``entries`` (:class:`~ckpt.wire.TensorEntry`, in send order) laid out in a
  receive buffer of ``bucket_size`` bytes, each at an offset its dtype can be viewed at in place, and
  ``segments`` (:class:`~ckpt.wire.Segment`) - the byte ranges actually moved: ``[0, front)`` holding every
  tensor copied into the send buffer, then one range per *run* (tensors back to back in one storage, or
  one large contiguous tensor) sent straight from the sender's storage, placed from the back;
* a **chunk** message: a slice ``[start, start + length)`` of the bytes of one tensor larger than a bucket;
  the receiver reassembles the chunks in a buffer of that tensor's size;
* an **end** message (``end``) closing the update, or an **abort** message (``abort="reason"``)
  when the sender failed on its side mid-update.

Every record carries the sender's ``step`` (``global_steps``) and ``bucket_size``. Bytes are the tensor's in-memory bytes
(``tensor.view(torch.uint8)``), so every dtype, 0-d, empty and non-contiguous tensors round-trip exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Iterator

import torch

from ckpt.errors import CheckpointConfigError
from ckpt.layout import ALIGN, AlignedCursor, align
from ckpt.wire import META_HEADER, Chunk, Segment, TensorEntry, WireMessage, dtype_name


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat ``uint8`` view (no copy); 0-d and empty tensors included."""
    return t.reshape(-1).view(torch.uint8)


def byte_view(buffer: torch.Tensor, offset: int, dtype: torch.dtype, shape: list[int] | tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``dtype``/``shape`` viewing ``buffer[offset:]`` (a flat ``uint8`` tensor); no copy."""
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * dtype.itemsize
    return buffer[offset:offset + nbytes].view(dtype).view(tuple(shape))


@dataclasses.dataclass
class Message:
    """One planned message of the sender.

    ``meta`` is its wire metadata; ``packed`` the ``(offset, tensor)`` pairs to copy into the send
    buffer; ``sources`` one entry per segment: a flat ``uint8`` tensor to send as is, or ``None`` for
    "the send buffer's bytes of that segment".
    """

    meta: WireMessage
    packed: list[tuple[int, torch.Tensor]] = dataclasses.field(default_factory=list)
    sources: list[torch.Tensor | None] = dataclasses.field(default_factory=list)
    rows: tuple[torch.Tensor, int] | None = None  # (rows of a non-contiguous big tensor, byte length)


class _Run:
    """Tensors that lie back to back in one storage: broadcast as one byte range, zero copy."""

    def __init__(self, tensor: torch.Tensor, entry: TensorEntry) -> None:
        self.storage = tensor.untyped_storage()
        self.base = self.storage.data_ptr()
        self.start = tensor.data_ptr()
        self.end = self.start + tensor.numel() * tensor.element_size()
        self.items = [(entry, tensor)]

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def adjacent(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() == self.base and tensor.data_ptr() == self.end


class _Planner:
    """Lays tensors out in one bucket; see :func:`plan_messages`.

    Packed tensors fill the bucket from the front (one segment ``[0, front)``), runs sent from their own
    storage fill it from the back, so a bucket costs one broadcast for everything packed plus one per run.
    A run is placed once it ends (its length is known then), keeping its in-storage alignment.
    """

    def __init__(self, step: int | None, bucket_size: int, budget: int, device: torch.device,
                 direct_threshold: int) -> None:
        self.step, self.bucket_size, self.budget = step, bucket_size, budget
        self.device, self.direct_threshold = device, direct_threshold
        self._reset()

    def _reset(self) -> None:
        self.msg = Message(meta=WireMessage(self.step, self.bucket_size))
        self.entries: list[TensorEntry] = []
        self.cursor, self.back, self.meta_used = AlignedCursor(), self.bucket_size, 0
        self.run: _Run | None = None

    def _fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more (plus alignment) fit between the packed front and the direct back."""
        return align(self.cursor.end) + nbytes + ALIGN <= self.back

    def _pack_at_front(self, items: list[tuple[TensorEntry, torch.Tensor]], start_ptr: int | None) -> None:
        """Place ``items`` at the front: one tensor at the next aligned offset, or a run (``start_ptr``: its
        first byte's address) at its relative in-storage offsets, congruent to its address."""
        if start_ptr is None:
            (entry, tensor), = items
            entry.offset = self.cursor.place(entry.nbytes)
        else:
            last, last_tensor = items[-1]
            base = self.cursor.place(last_tensor.data_ptr() - start_ptr + last.nbytes, congruent_to=start_ptr)
            for entry, tensor in items:
                entry.offset = base + tensor.data_ptr() - start_ptr
        for entry, tensor in items:
            self.msg.packed.append((entry.offset, tensor))

    def _flush_run(self) -> None:
        run, self.run = self.run, None
        if run is None:
            return
        if run.nbytes >= self.direct_threshold:
            offset = self.back - run.nbytes
            offset -= (offset - run.start) % ALIGN  # congruent to the storage address: alignment kept
            for entry, tensor in run.items:
                entry.offset = offset + (tensor.data_ptr() - run.start)
            source = torch.empty(0, dtype=torch.uint8, device=self.device).set_(
                run.storage, run.start - run.base, (run.nbytes,), (1,))
            self.msg.meta.segments.append(Segment(offset, run.nbytes))
            self.msg.sources.append(source)
            self.back = offset
        else:
            self._pack_at_front(run.items, run.start)

    def close(self) -> Message:
        self._flush_run()
        if self.cursor.end:
            self.msg.meta.segments.insert(0, Segment(0, self.cursor.end))
            self.msg.sources.insert(0, None)
        self.msg.meta.entries = self.entries
        done = self.msg
        self._reset()
        return done

    def add(self, name: str, tensor: torch.Tensor, nbytes: int) -> Message | None:
        """Add one tensor (at most a bucket); returns the bucket it closed, if it did not fit."""
        entry = TensorEntry(name, dtype_name(tensor.dtype), list(tensor.shape), 0, nbytes)
        esize = entry.encoded_size()
        if esize > self.budget:
            raise CheckpointConfigError(f"metadata of tensor {name!r} takes {esize} bytes, more than the "
                                        f"meta_capacity allows; raise meta_capacity")
        eligible = (self.direct_threshold > 0 and nbytes > 0 and nbytes + 2 * ALIGN <= self.bucket_size
                    and tensor.is_contiguous() and tensor.device == self.device)
        meta_ok = self.meta_used + esize <= self.budget
        if (eligible and meta_ok and self.run is not None and self.run.adjacent(tensor)
                and self._fits(self.run.nbytes + nbytes)):
            self._add_entry(entry, esize)
            self.run.items.append((entry, tensor))
            self.run.end += nbytes
            return None
        self._flush_run()
        closed = None
        if self.entries and not (meta_ok and self._fits(nbytes)):
            closed = self.close()
        self._add_entry(entry, esize)
        if eligible:
            self.run = _Run(tensor, entry)
        else:
            self._pack_at_front([(entry, tensor)], None)
        return closed

    def _add_entry(self, entry: TensorEntry, esize: int) -> None:
        self.entries.append(entry)
        self.meta_used += esize


def plan_messages(weights: Iterable[tuple[str, torch.Tensor]], step: int | None, bucket_size: int,
                  meta_capacity: int, device: torch.device, direct_threshold: int) -> Iterator[Message]:
    """Group ``weights`` into messages, lazily (one bucket of lookahead, never the whole model).

    Tensors that lie back to back in one storage (views into a flat parameter buffer, as FSDP1 or
    Megatron keep them) form a *run*; a run of at least ``direct_threshold`` bytes, contiguous and on
    ``device``, is broadcast straight from that storage (zero copy), laid out in the bucket at the same
    relative offsets so every tensor keeps its alignment. Everything else is copied into the send buffer.

    Args:
        weights: ``(name, tensor)`` pairs, any dtype/shape/strides/device.
        step: the ``global_steps`` to tag every record with.
        bucket_size: bytes of a bucket; tensors above it are split into chunk messages.
        meta_capacity: bytes of the metadata tensor; a bucket also closes when its record would overflow it.
        device: the transfer device.
        direct_threshold: bytes from which a run is sent from its own storage; ``0`` packs everything.

    Raises:
        CheckpointConfigError: a name is not a str, a value is not a tensor, or one metadata entry alone
            exceeds ``meta_capacity``.
    """
    planner = _Planner(step, bucket_size, meta_capacity - META_HEADER - 256, device, direct_threshold)
    for name, tensor in weights:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise CheckpointConfigError(f"weights must yield (str, torch.Tensor) pairs, got ({name!r}, {type(tensor).__name__})")
        tensor = tensor.detach()
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > bucket_size:
            if planner.entries:
                yield planner.close()
            yield from _chunk_messages(name, tensor, nbytes, step, bucket_size, device)
            continue
        closed = planner.add(name, tensor, nbytes)
        if closed is not None:
            yield closed
    if planner.entries:
        yield planner.close()
    yield Message(meta=WireMessage(step, bucket_size, end=True))


def _chunk_messages(name: str, tensor: torch.Tensor, nbytes: int, step: int | None, bucket_size: int,
                    device: torch.device) -> Iterator[Message]:
    """Chunk messages for one tensor larger than a bucket.

    A contiguous tensor on ``device`` is sent from its own storage in byte slices of ``bucket_size``. Any
    other is copied through the send buffer a block of dim-0 rows at a time, so the sender never holds a
    second copy of it; only a tensor whose single row exceeds a bucket is made contiguous first.
    """
    head = dict(name=name, dtype=dtype_name(tensor.dtype), shape=list(tensor.shape), nbytes=nbytes)
    tensor = tensor.detach()
    row_bytes = nbytes // tensor.shape[0] if tensor.dim() else nbytes
    direct = tensor.is_contiguous() and tensor.device == device
    if not direct and row_bytes > bucket_size:
        tensor, direct = tensor.contiguous().to(device), True
    if direct:
        flat = as_bytes(tensor)
        for start in range(0, nbytes, bucket_size):
            length = min(bucket_size, nbytes - start)
            yield Message(meta=WireMessage(step, bucket_size, chunk=Chunk(**head, start=start, length=length),
                                           segments=[Segment(0, length)]), sources=[flat[start:start + length]])
        return
    rows_per = bucket_size // row_bytes
    for r in range(0, tensor.shape[0], rows_per):
        rows = tensor[r:r + rows_per]
        length = rows.shape[0] * row_bytes
        yield Message(meta=WireMessage(step, bucket_size, chunk=Chunk(**head, start=r * row_bytes, length=length),
                                       segments=[Segment(0, length)]), sources=[None], rows=(rows, length))


def pack(msg: Message, buffer: torch.Tensor) -> None:
    """Copy the packed tensors (and rows of a chunk) of ``msg`` into ``buffer`` (flat ``uint8``), in place."""
    for offset, tensor in msg.packed:
        byte_view(buffer, offset, tensor.dtype, tensor.shape).copy_(tensor)
    if msg.rows is not None:
        rows, _ = msg.rows
        byte_view(buffer, 0, rows.dtype, rows.shape).copy_(rows)
