"""Packing named tensors into fixed-size byte buckets, as the messages :mod:`ckpt.wire` describes.

A bucket message's segments are ``[0, front)``, holding every tensor copied into the send buffer (each at an
offset its dtype can be viewed at in place), then one range per *run* (tensors back to back in one storage,
or one large contiguous tensor) sent straight from the sender's storage, placed from the back. A tensor
larger than a bucket travels as chunk messages. Bytes are the tensors' in-memory bytes, so every dtype, 0-d,
empty and non-contiguous tensor round-trips exactly."""

from __future__ import annotations

import collections.abc
import dataclasses
from typing import Callable, Iterable, Iterator, Mapping

import torch

from ckpt.base import named_tensors
from ckpt.errors import CheckpointConfigError
from ckpt.layout import ALIGN, AlignedCursor, align, byte_view
from ckpt.wire import META_HEADER, Chunk, Segment, TensorEntry, WireMessage, dtype_name


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Return a contiguous tensor's bytes as a flat ``uint8`` view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


@dataclasses.dataclass
class Message:
    """One planned message of the sender.

    ``buffer``: the send buffer its copied bytes went into (``None``: nothing copied); ``sources``: per segment,
    a flat ``uint8`` run of the caller's memory to send as is, or ``None`` for ``buffer``'s bytes."""

    meta: WireMessage
    buffer: torch.Tensor | None = None
    sources: list[torch.Tensor | None] = dataclasses.field(default_factory=list)

    def segment_bytes(self) -> list[tuple[int, int, torch.Tensor]]:
        """Return ``(offset, nbytes, flat uint8 source)`` of every segment."""
        out = []
        for seg, source in zip(self.meta.segments, self.sources):
            if source is None:
                source = self.buffer[seg.offset:seg.offset + seg.nbytes]
            out.append((seg.offset, seg.nbytes, source))
        return out


class _Run:

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
    """Lays tensors out in one bucket: packed ones from the front, runs from their own storage from the back."""

    def __init__(self, step: int | None, bucket_size: int, budget: int, device: torch.device,
                 direct_threshold: int, buffer_for: Callable[[int], torch.Tensor], stable: bool) -> None:
        self.step, self.bucket_size, self.budget = step, bucket_size, budget
        self.device, self.direct_threshold = device, direct_threshold
        self.buffer_for, self.stable = buffer_for, stable
        self.yielded = 0  # messages handed to the sender so far: the current bucket's index
        self.deferred: list[tuple[TensorEntry, torch.Tensor]] = []
        self._reset()

    def copy_in(self, offset: int, tensor: torch.Tensor) -> None:
        if self.msg.buffer is None:
            self.msg.buffer = self.buffer_for(self.yielded)
        byte_view(self.msg.buffer, offset, tensor.dtype, tensor.shape).copy_(tensor)

    def copy_deferred(self) -> None:
        """Copy the tensor that closed the previous bucket into the new one, once that bucket was handed on."""
        for entry, tensor in self.deferred:
            self.copy_in(entry.offset, tensor)
        self.deferred = []

    def _reset(self) -> None:
        self.msg = Message(meta=WireMessage(self.step, self.bucket_size))
        self.entries: list[TensorEntry] = []
        self.cursor, self.back, self.meta_used = AlignedCursor(), self.bucket_size, 0
        self.run: _Run | None = None
        self.closing = False  # the tensor being added closed the previous bucket: its copy waits

    def _fits(self, nbytes: int) -> bool:
        return align(self.cursor.end) + nbytes + ALIGN <= self.back

    def _pack_at_front(self, items: list[tuple[TensorEntry, torch.Tensor]], start_ptr: int | None) -> None:
        """Place ``items`` at the front: one tensor aligned, or a run (from ``start_ptr``) at its relative offsets."""
        if start_ptr is None:
            (entry, tensor), = items
            entry.offset = self.cursor.place(entry.nbytes)
        else:
            last, last_tensor = items[-1]
            base = self.cursor.place(last_tensor.data_ptr() - start_ptr + last.nbytes, congruent_to=start_ptr)
            for entry, tensor in items:
                entry.offset = base + tensor.data_ptr() - start_ptr
        for entry, tensor in items:
            if self.closing:
                self.deferred.append((entry, tensor))
            else:
                self.copy_in(entry.offset, tensor)

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

    def add(self, name: str, tensor: torch.Tensor, nbytes: int,
            part: tuple[list[int], int] | None = None) -> Message | None:
        """Add one tensor of at most a bucket; return the bucket it closed, if it did not fit."""
        entry = TensorEntry(name, dtype_name(tensor.dtype), list(tensor.shape), 0, nbytes)
        if part is not None:
            entry.full_shape, entry.row_start = list(part[0]), int(part[1])
        esize = entry.encoded_size()
        if esize > self.budget:
            raise CheckpointConfigError(f"metadata of tensor {name!r} takes {esize} bytes, more than the "
                                        f"meta_capacity allows; raise meta_capacity")
        eligible = (self.stable and self.direct_threshold > 0 and nbytes > 0 and nbytes + 2 * ALIGN <= self.bucket_size
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
            self.closing = closed is not None
            self._pack_at_front([(entry, tensor)], None)
            self.closing = False
        return closed

    def _add_entry(self, entry: TensorEntry, esize: int) -> None:
        self.entries.append(entry)
        self.meta_used += esize


def plan_messages(weights: Iterable[tuple[str, torch.Tensor]], step: int | None, bucket_size: int,
                  meta_capacity: int, device: torch.device, direct_threshold: int,
                  buffer_for: Callable[[int], torch.Tensor] | None = None,
                  parts: Mapping[str, tuple[list[int], int]] | None = None) -> Iterator[Message]:
    """Group ``weights`` into messages lazily (one bucket of lookahead).

    Each tensor's bytes are taken when it is yielded, so an iterator that reuses one staging buffer is sent
    what each tensor held then. Only when ``weights`` is a collection, runs of at least ``direct_threshold``
    bytes on ``device`` (and contiguous tensors larger than a bucket) are sent from their own storage.
    ``buffer_for(k)`` gives message k's send buffer, asked for after message k - 1 was handed on (``None``: a
    new zero-filled one). ``meta_capacity``: bytes of the metadata record; a bucket closes when it is full."""
    if buffer_for is None:
        def buffer_for(k: int) -> torch.Tensor:
            return torch.zeros(bucket_size, dtype=torch.uint8, device=device)
    stable = isinstance(weights, collections.abc.Collection)
    planner = _Planner(step, bucket_size, meta_capacity - META_HEADER - 256, device, direct_threshold,
                       buffer_for, stable)
    for name, tensor in named_tensors(weights):
        tensor = tensor.detach()
        nbytes = tensor.numel() * tensor.element_size()
        part = parts.get(name) if parts else None
        if nbytes > bucket_size:
            if planner.entries:
                closed = planner.close()  # close first: it may copy a pending short run into this bucket's buffer
                planner.yielded += 1
                yield closed
            for msg in _chunk_messages(name, tensor, nbytes, step, bucket_size, device, stable,
                                       lambda: buffer_for(planner.yielded), part):
                planner.yielded += 1
                yield msg
            continue
        closed = planner.add(name, tensor, nbytes, part)
        if closed is not None:
            planner.yielded += 1
            yield closed
            planner.copy_deferred()
    if planner.entries:
        closed = planner.close()  # close first: a pending short run is copied into buffer_for(this bucket's index)
        planner.yielded += 1
        yield closed
    yield Message(meta=WireMessage(step, bucket_size, end=True))


def _chunk_messages(name: str, tensor: torch.Tensor, nbytes: int, step: int | None, bucket_size: int,
                    device: torch.device, stable: bool, next_buffer: Callable[[], torch.Tensor],
                    part: tuple[list[int], int] | None = None) -> Iterator[Message]:
    """Yield chunk messages for one tensor larger than a bucket, from its own storage or through the send buffer.

    Only a non-contiguous tensor whose single row exceeds a bucket is made contiguous first."""
    head = dict(name=name, dtype=dtype_name(tensor.dtype), shape=list(tensor.shape), nbytes=nbytes)
    if part is not None:
        head.update(full_shape=list(part[0]), row_start=int(part[1]))
    row_bytes = nbytes // tensor.shape[0] if tensor.dim() else nbytes
    direct = stable and tensor.is_contiguous() and tensor.device == device
    if not direct and not tensor.is_contiguous() and row_bytes > bucket_size:
        tensor, direct = tensor.contiguous().to(device), True  # a private copy: nobody else can change it
    if direct or tensor.is_contiguous():
        flat = as_bytes(tensor)
        for start in range(0, nbytes, bucket_size):
            length = min(bucket_size, nbytes - start)
            meta = WireMessage(step, bucket_size, chunk=Chunk(**head, start=start, length=length),
                               segments=[Segment(0, length)])
            if direct:
                yield Message(meta=meta, sources=[flat[start:start + length]])
            else:
                buffer = next_buffer()
                buffer[:length].copy_(flat[start:start + length])
                yield Message(meta=meta, buffer=buffer, sources=[None])
        return
    rows_per = bucket_size // row_bytes
    for r in range(0, tensor.shape[0], rows_per):
        rows = tensor[r:r + rows_per]
        length = rows.shape[0] * row_bytes
        buffer = next_buffer()
        byte_view(buffer, 0, rows.dtype, rows.shape).copy_(rows)
        yield Message(meta=WireMessage(step, bucket_size, chunk=Chunk(**head, start=r * row_bytes, length=length),
                                       segments=[Segment(0, length)]), buffer=buffer, sources=[None])
