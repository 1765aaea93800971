"""The sender's diff: published tensors against a host snapshot, on 64-bit words, one region at a time.

A *segment* is one region diffed at once: same-dtype views of one storage, each 8-byte aligned and less than
64 bytes after the previous (``hal sync``'s flat buffer), or a single tensor. The torch path compares the
region's words in one pass and reduces per-tensor counts, NaNs and checksum changes with ``index_add_`` (one
host sync per region); large mostly-changed tensors are decided dense on counts. On host memory the C loop of
:mod:`ckpt.delta.kernel` reads each word once and writes (int32 position, value) pairs straight into the
output. Both paths give the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ckpt.delta import kernel
from ckpt.delta.checksum import add_parts, parts_and_copy, raw_words
from ckpt.delta.wire import POS_WIDTH
from ckpt.errors import CheckpointConfigError

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Bytes allowed between two views of one segment (the alignment padding of a flat buffer).
MAX_GAP = 64
# A segment closes at this many bytes: the diff's temporaries are bounded by a segment, not the model.
SEGMENT_BYTES = 16 << 20
# Tensors of at least this many words have their changed words counted first (may go dense on counts).
COUNT_WORDS = 8192


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """Return contiguous ``tensor`` flattened as the signed integer of its element size (``==`` compares bits)."""
    flat = tensor.reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    try:
        return flat.view(_INT_VIEW[flat.element_size()])
    except KeyError:
        raise CheckpointConfigError(f"cannot diff dtype {flat.dtype} bit-wise (element size "
                                    f"{flat.element_size()}; accepted sizes: {sorted(_INT_VIEW)})") from None


# The largest flat position verl's int32 indices encoding holds: a tensor of more values goes dense.
MAX_POSITION = 2**31 - 1


def goes_dense(changed: int, nbytes: int, element_size: int) -> bool:
    """Return whether ``changed`` values as positions + values take at least ``nbytes`` (or exceed int32)."""
    return changed * (POS_WIDTH + element_size) >= nbytes or nbytes // element_size > MAX_POSITION + 1


def sparse_limit(nbytes: int, element_size: int) -> int:
    """Return the most changed values a tensor of ``nbytes`` still sends sparse (``-1``: always dense)."""
    if nbytes // element_size > MAX_POSITION + 1:
        return -1
    return (nbytes - 1) // (POS_WIDTH + element_size)


# (absmask, infbits) per floating dtype the C diff knows: NaN when bits & absmask > infbits (IEEE 754, OCP
# FP8 e4m3fn); other float dtypes take the torch path.
NAN_RULES: dict[torch.dtype, tuple[int, int]] = {
    torch.bfloat16: (0x7FFF, 0x7F80), torch.float16: (0x7FFF, 0x7C00),
    torch.float32: (0x7FFFFFFF, 0x7F800000), torch.float64: (0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
    torch.float8_e4m3fn: (0x7F, 0x7E), torch.float8_e5m2: (0x7F, 0x7C),
}


@dataclass
class Segment:
    """Tensors diffed as one region: ``offsets`` in bytes (multiples of 8), ``words`` (int64), ``key`` (layout)."""

    names: list[str]
    tensors: list[torch.Tensor]
    offsets: list[int]
    words: torch.Tensor
    key: tuple = field(default=())


def _storage_bytes(t: torch.Tensor) -> tuple[int, int, int]:
    """Return (storage pointer, byte offset of ``t`` in it, storage bytes)."""
    st = t.untyped_storage()
    return st.data_ptr(), t.storage_offset() * t.element_size(), st.nbytes()


def segments(items: list[tuple[str, torch.Tensor]]) -> list[Segment]:
    """Group ``(name, contiguous tensor)`` pairs, in order, into :class:`Segment` regions (misfits: one each)."""
    out: list[Segment] = []
    run: list[tuple[str, torch.Tensor, int]] = []  # (name, tensor, byte offset in storage)
    run_ptr = run_end = None

    def close() -> None:
        nonlocal run, run_ptr, run_end
        if run:
            out.extend(_region(run))
        run, run_ptr, run_end = [], None, None

    for name, t in items:
        ptr, off, _ = _storage_bytes(t)
        aligned = t.is_contiguous() and off % 8 == 0 and t.numel() > 0
        if not aligned:
            close()
            out.append(_single(name, t))
            continue
        if run and (ptr != run_ptr or t.dtype != run[0][1].dtype or t.device != run[0][1].device
                    or not 0 <= off - run_end < MAX_GAP or run_end - run[0][2] >= SEGMENT_BYTES):
            close()
        run.append((name, t, off))
        run_ptr, run_end = ptr, off + t.numel() * t.element_size()
    close()
    return out


def _single(name: str, t: torch.Tensor) -> Segment:
    return Segment([name], [t], [0], raw_words(t), (t.dtype, ((name, tuple(t.shape), 0),)))


def _region(run: list[tuple[str, torch.Tensor, int]]) -> list[Segment]:
    first = run[0][1]
    _, start, storage_bytes = _storage_bytes(first)
    end = run[-1][2] + run[-1][1].numel() * run[-1][1].element_size()
    end8 = -(-end // 8) * 8
    if end8 > storage_bytes:  # the last tensor ends mid-word at the storage's end: it goes alone (a copy)
        return (_region(run[:-1]) if len(run) > 1 else []) + [_single(run[-1][0], run[-1][1])]
    if len(run) == 1 and end8 == end:
        return [_single(run[0][0], first)]
    raw = torch.empty(0, dtype=torch.uint8, device=first.device).set_(first.untyped_storage())
    words = raw[start:end8].view(torch.int64)
    offsets = [off - start for _, _, off in run]
    key = (first.dtype, tuple((n, tuple(t.shape), o) for (n, t, _), o in zip(run, offsets)))
    return [Segment([n for n, _, _ in run], [t for _, t, _ in run], offsets, words, key)]


@dataclass
class TensorDiff:
    """One tensor's diff: ``changed`` values, ``dense`` or ``positions``/``values``, and its new checksum ``parts``."""

    changed: int
    dense: bool
    parts: tuple[int, int]
    positions: torch.Tensor | None = None
    values: torch.Tensor | None = None


def _rows(seg: Segment) -> np.ndarray:
    """Return the C diff's per-tensor rows of ``seg`` with ``W0``, ``NBYTES``, ``CMAX`` filled."""
    es = seg.tensors[0].element_size()
    rows = np.zeros((len(seg.tensors), kernel.ROW), dtype=np.int64)
    for row, t, off in zip(rows, seg.tensors, seg.offsets):
        nbytes = t.numel() * es
        row[kernel.W0], row[kernel.NBYTES], row[kernel.CMAX] = off // 8, nbytes, sparse_limit(nbytes, es)
    return rows


def _kernel_for(seg: Segment, snapshot: torch.Tensor):
    """Return the C library when it can diff ``seg`` (host memory, a known NaN rule), else ``None``."""
    dtype = seg.tensors[0].dtype
    if not seg.words.is_cpu or not snapshot.is_cpu or (
            dtype.is_floating_point and dtype not in NAN_RULES):
        return None
    return kernel.library()


def seed_segment(seg: Segment, snapshot: torch.Tensor) -> list[tuple[int, int]]:
    """Copy ``seg``'s words into ``snapshot`` and return each tensor's checksum parts, in one read."""
    lib = _kernel_for(seg, snapshot)
    if lib is not None:
        rows = _rows(seg)
        kernel.seed(lib, seg.words, snapshot, seg.tensors[0].element_size(), rows)
        return [add_parts((0, 0), int(r[kernel.DW]), int(r[kernel.DS])) for r in rows]
    parts = []
    pos = 0
    for t, off in zip(seg.tensors, seg.offsets):
        w0, nb = off // 8, t.numel() * t.element_size()
        if w0 > pos:  # alignment padding between views
            snapshot[pos:w0].copy_(seg.words[pos:w0])
        parts.append(_tensor_parts_and_copy(seg.words, snapshot, w0, nb))
        pos = w0 + -(-nb // 8)
    if pos < seg.words.numel():
        snapshot[pos:].copy_(seg.words[pos:])
    return parts


def _tensor_parts_and_copy(words: torch.Tensor, snapshot: torch.Tensor, w0: int, nbytes: int) -> tuple[int, int]:
    """Return the parts of the ``nbytes``-byte tensor at word ``w0`` of ``words``, copying it into ``snapshot``."""
    whole = nbytes // 8
    parts = parts_and_copy(words[w0:w0 + whole], snapshot[w0:w0 + whole])
    rest = nbytes - whole * 8
    if rest:
        last = words[w0 + whole:w0 + whole + 1]
        snapshot[w0 + whole:w0 + whole + 1].copy_(last)
        masked = int(last.item()) & ((1 << (8 * rest)) - 1)
        parts = add_parts(parts, masked * (2 * whole + 1), masked)
    return parts


class Outputs:
    """Buffers the C diff writes an update's (position, value) pairs into, kept from update to update.

    Consecutive sparse tensors' pairs lie back to back, so a flush of them is a view (:func:`join`). :meth:`start`
    rewinds them: the previous update's flushes must have been sent by then.
    """

    def __init__(self) -> None:
        self.pos = torch.empty(0, dtype=torch.int32)
        self.vals = torch.empty(0, dtype=torch.uint8)
        self.at = self.vat = 0  # next free entry of pos, byte of vals

    def start(self) -> None:
        """Rewind to the start of the buffers (a new update)."""
        self.at = self.vat = 0

    def reserve(self, entries: int, es: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(int32 positions, byte values)`` views with room for ``entries`` pairs of ``es``-byte values."""
        self.vat = -(-self.vat // es) * es
        if self.at + entries > self.pos.numel() or self.vat + entries * es > self.vals.numel():
            size = max(2 * self.pos.numel(), entries, 1 << 16)
            self.pos = torch.empty(size, dtype=torch.int32)
            self.vals = torch.empty(size * 8, dtype=torch.uint8)
            self.at = self.vat = 0
        return self.pos[self.at:self.at + entries], self.vals[self.vat:self.vat + entries * es]

    def advance(self, entries: int, es: int) -> None:
        self.at += entries
        self.vat += entries * es


def join(parts: list[torch.Tensor], max_gap: int = 0) -> tuple[torch.Tensor, list[int]]:
    """Return ``parts`` as one tensor (a view where adjacent in one storage, else ``torch.cat``) and offsets."""
    first = parts[0]
    es, start = first.element_size(), first.data_ptr()
    base, at, end = first.untyped_storage().data_ptr(), [], start
    for p in parts:
        gap = p.data_ptr() - end
        if p.untyped_storage().data_ptr() != base or p.dtype != first.dtype or p.stride() != (1,) \
                or not 0 <= gap <= max_gap or gap % es:
            at = [0]
            for q in parts[:-1]:
                at.append(at[-1] + q.numel())
            return (torch.cat(parts) if len(parts) > 1 else first), at
        at.append((p.data_ptr() - start) // es)
        end = p.data_ptr() + p.numel() * es
    return first.as_strided(((end - start) // es,), (1,)), at


def diff_segment(seg: Segment, snapshot: torch.Tensor, old_parts: list[tuple[int, int]], pin: bool,
                 outputs: Outputs | None = None) -> list[TensorDiff | None]:
    """Diff ``seg`` against ``snapshot``, bring the snapshot up to date, and return each :class:`TensorDiff`.

    ``None`` for an unchanged tensor. The C loop on host memory, else torch/numpy passes; the same bits.
    """
    lib = _kernel_for(seg, snapshot)
    if lib is not None:
        return diff_segment_kernel(lib, seg, snapshot, old_parts, outputs)
    return diff_segment_torch(seg, snapshot, old_parts, pin)


def diff_segment_kernel(lib, seg: Segment, snapshot: torch.Tensor, old_parts: list[tuple[int, int]],
                        outputs: Outputs | None = None) -> list[TensorDiff | None]:
    """Run :func:`diff_segment` by the C loop ``lib``; sparse results are views into ``outputs``."""
    es = seg.tensors[0].element_size()
    dtype = seg.tensors[0].dtype
    rows = _rows(seg)
    outputs = outputs if outputs is not None else Outputs()
    tpos, raw = outputs.reserve(kernel.capacity(rows, es), es)
    written = kernel.diff(lib, seg.words, snapshot, es, rows, tpos, raw,
                          NAN_RULES.get(dtype) if dtype.is_floating_point else None)
    outputs.advance(written, es)
    tvals = raw.view(dtype)
    result: list[TensorDiff | None] = []
    for row, parts in zip(rows.tolist(), old_parts):
        changed = row[kernel.CHANGED]
        if changed == 0:
            result.append(None)
            continue
        parts = add_parts(parts, row[kernel.DW], row[kernel.DS])
        if row[kernel.DENSE]:
            result.append(TensorDiff(changed, True, parts))
        else:
            o0, o1 = row[kernel.OUT0], row[kernel.OUT1]
            result.append(TensorDiff(changed, False, parts, tpos[o0:o1], tvals[o0:o1]))
    return result


def diff_segment_torch(seg: Segment, snapshot: torch.Tensor, old_parts: list[tuple[int, int]], pin: bool
                       ) -> list[TensorDiff | None]:
    """Run :func:`diff_segment` by torch/numpy passes on the tensors' device."""
    new = seg.words
    dev = new.device
    old = snapshot if snapshot.device == dev else snapshot.to(dev, non_blocking=pin)
    differs = ne(new, old)
    es = seg.tensors[0].element_size()
    per = 8 // es
    nt = len(seg.tensors)
    nbytes = [t.numel() * es for t in seg.tensors]
    w0s = [off // 8 for off in seg.offsets]
    w1s = [w0 + -(-nb // 8) for w0, nb in zip(w0s, nbytes)]
    result: list[TensorDiff | None] = [None] * nt
    # large tensors: count changed words; those that may go dense are decided on counts
    big = [i for i in range(nt) if w1s[i] - w0s[i] >= COUNT_WORDS]
    dense_now: list[int] = []
    if big:
        counts = torch.stack([torch.count_nonzero(differs[w0s[i]:w1s[i]]) for i in big]).tolist()
        for i, k in zip(big, counts):
            if k == 0 or not goes_dense(per * k, nbytes[i], es):
                continue  # surely sparse (at most per values in each changed word) or unchanged
            changed = _count_if_dense(seg.tensors[i], old, w0s[i], k, per)
            if changed is not None:
                dense_now.append(i)
                result[i] = TensorDiff(changed, True, (0, 0))
    for i in dense_now:
        differs[w0s[i]:w1s[i]] = False
        host = snapshot if snapshot.device == dev else None
        if host is not None:
            result[i].parts = _tensor_parts_and_copy(new, snapshot, w0s[i], nbytes[i])
        else:
            result[i].parts = _tensor_parts_and_copy(new, old, w0s[i], nbytes[i])
            snapshot[w0s[i]:w1s[i]].copy_(old[w0s[i]:w1s[i]])
    widx = nonzero(differs)
    del differs
    if widx.numel() == 0:
        return result
    new_ws, old_ws = take(new, widx), take(old, widx)
    snapshot.index_copy_(0, widx.to(snapshot.device), new_ws.to(snapshot.device))
    i64 = dict(dtype=torch.int64, device=dev)
    w0_t, w1_t = torch.tensor(w0s, **i64), torch.tensor(w1s, **i64)
    dw_t, ds_t = _word_sums(widx, new_ws, old_ws, w0_t, w1_t, nbytes)
    # the changed values: within the changed words, value by value
    dtype = seg.tensors[0].dtype
    nb = bits(new_ws.view(dtype))
    if per == 1:
        epos = widx
    else:
        j = nonzero(ne(nb, bits(old_ws.view(dtype))))
        shift = per.bit_length() - 1
        epos = (take(widx, j >> shift) << shift) | (j & (per - 1))  # value index in the region
        nb = take(nb, j)
    values = nb.view(dtype)
    starts = torch.tensor([off // es for off in seg.offsets], **i64)
    ends = starts + torch.tensor([t.numel() for t in seg.tensors], **i64)
    lo, hi = torch.searchsorted(epos, starts), torch.searchsorted(epos, ends)  # padding between views: no one's
    rows = [lo, hi - lo, dw_t, ds_t]
    if values.is_floating_point():  # NaN cannot travel sparse (verl's SGLang loader reads NaN as "unchanged")
        nan = torch.cat([torch.zeros(1, **i64), torch.isnan(values).cumsum(0)])
        rows.append(nan.index_select(0, hi) - nan.index_select(0, lo))
    summary = torch.stack(rows).tolist()
    for i in range(nt):
        start, c = summary[0][i], summary[1][i]
        if result[i] is not None or c == 0:
            continue
        parts = add_parts(old_parts[i], summary[2][i], summary[3][i])
        if goes_dense(c, nbytes[i], es) or (len(summary) > 4 and summary[4][i]):
            result[i] = TensorDiff(c, True, parts)
        else:
            local = (epos[start:start + c] - seg.offsets[i] // es).to(torch.int32)
            result[i] = TensorDiff(c, False, parts, local, values[start:start + c])
    return result


def _word_sums(widx: torch.Tensor, new_ws: torch.Tensor, old_ws: torch.Tensor, w0_t: torch.Tensor,
               w1_t: torch.Tensor, nbytes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Return each tensor's checksum change ``(dW, dS)`` from the region's changed words ``widx``."""
    dev = widx.device
    d = new_ws - old_ws
    cd = torch.zeros(d.numel() + 1, dtype=torch.int64, device=dev)  # running sums with a leading 0
    ca = torch.zeros(d.numel() + 1, dtype=torch.int64, device=dev)
    torch.cumsum(d, 0, out=cd[1:])
    torch.cumsum(d * widx, 0, out=ca[1:])
    lo, hi = torch.searchsorted(widx, w0_t), torch.searchsorted(widx, w1_t)
    ds = cd.index_select(0, hi) - cd.index_select(0, lo)
    # sum d (2 (w - w0) + 1) = 2 (sum d w - w0 sum d) + sum d
    dw = (ca.index_select(0, hi) - ca.index_select(0, lo) - w0_t * ds) * 2 + ds
    tails = [i for i, nb in enumerate(nbytes) if nb % 8]
    if tails:  # a last word that ends mid-word: count the change of the tensor's own bytes only
        ti = torch.tensor(tails, dtype=torch.int64, device=dev)
        last = w1_t.index_select(0, ti) - 1
        at = (hi.index_select(0, ti) - 1).clamp(min=0)
        hit = (hi.index_select(0, ti) > lo.index_select(0, ti)) & (widx.index_select(0, at) == last)
        mask = torch.tensor([(1 << (8 * (nbytes[i] % 8))) - 1 for i in tails], dtype=torch.int64, device=dev)
        nw, ow = new_ws.index_select(0, at), old_ws.index_select(0, at)
        fix = (((nw & mask) - (ow & mask)) - (nw - ow)) * hit
        ds = ds.index_add(0, ti, fix)
        dw = dw.index_add(0, ti, fix * ((last - w0_t.index_select(0, ti)) * 2 + 1))
    return dw, ds


def _count_if_dense(t: torch.Tensor, old: torch.Tensor, w0: int, words: int, per: int) -> int | None:
    """Return how many of ``t``'s values differ if that many make it go dense, else ``None``."""
    es = t.element_size()
    nbytes = t.numel() * es
    changed = words if per == 1 else count_ne(bits(t), bits(old.view(torch.uint8)[w0 * 8:w0 * 8 + nbytes].view(t.dtype)))
    return changed if goes_dense(changed, nbytes, es) else None


def ne(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Return ``a != b`` of integer tensors (through numpy on host memory)."""
    if a.is_cpu:
        import numpy as np

        return torch.from_numpy(np.not_equal(a.numpy(), b.numpy()))
    return torch.ne(a, b)


def nonzero(mask: torch.Tensor) -> torch.Tensor:
    """Return the ascending flat indices where 1-D bool ``mask`` is set (through numpy on host memory)."""
    if mask.is_cpu:
        import numpy as np

        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return mask.nonzero().reshape(-1)


def take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Return ``x.index_select(0, index)`` for 1-D integer ``x`` (through numpy on host memory)."""
    if x.is_cpu:
        import numpy as np

        return torch.from_numpy(np.take(x.numpy(), index.numpy()))
    return x.index_select(0, index)


def count_ne(a: torch.Tensor, b: torch.Tensor) -> int:
    """Return how many elements of integer tensors ``a`` and ``b`` differ (through numpy on host memory)."""
    if a.is_cpu:
        import numpy as np

        return int(np.count_nonzero(np.not_equal(a.numpy(), b.numpy())))
    return int(torch.count_nonzero(torch.ne(a, b)))
