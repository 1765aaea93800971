"""The sender's diff: published tensors against a host snapshot, on 64-bit words, one region at a time.

A *segment* is one region of memory diffed at once: tensors of one dtype laid out as views into one storage,
each starting on an 8-byte boundary and less than 64 bytes after the previous one ends (as ``hal sync``'s
trainer publishes them: one flat buffer, 64-byte aligned views), or a single tensor. The region's words are
compared with the snapshot's in one pass (one read of each: :func:`diff_segment`); the changed words, and
within them the changed elements, are found for the whole region at once, mapped to tensors with
``searchsorted``, and each tensor's count, NaNs and checksum change are reduced with ``index_add_``: a
handful of torch ops and one host sync per region, not per tensor. Large tensors whose words mostly
changed are decided dense on counts first and copied into the snapshot while computing their checksum
(:func:`ckpt.delta.checksum.parts_and_copy`: one more read of those only).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ckpt.delta.checksum import add_parts, parts_and_copy, raw_words
from ckpt.delta.wire import POS_WIDTH
from ckpt.errors import CheckpointConfigError

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
MAX_GAP = 64
"""Bytes allowed between two views of one segment (the alignment padding of a flat buffer)."""
SEGMENT_BYTES = 16 << 20
"""A segment closes once it holds this many bytes (a larger tensor is a segment of its own): the diff's
temporaries (a bool per word, the changed words and values) are bounded by a segment, not the model."""
COUNT_WORDS = 8192
"""Tensors of at least this many words get their changed words counted before the positions are found:
one that may go dense is decided on counts (no positions for it)."""


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (contiguous) flattened and viewed as the signed integer type of its element size, so
    ``==`` compares raw bits (NaN equals itself, ``-0.0`` differs from ``0.0``).

    Raises:
        CheckpointConfigError: an element size with no integer type (complex128 and the like).
    """
    flat = tensor.reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    try:
        return flat.view(_INT_VIEW[flat.element_size()])
    except KeyError:
        raise CheckpointConfigError(f"cannot diff dtype {flat.dtype} bit-wise (element size "
                                    f"{flat.element_size()}; accepted sizes: {sorted(_INT_VIEW)})") from None


def goes_dense(changed: int, nbytes: int, element_size: int) -> bool:
    """Whether ``changed`` values as a delta (positions + values) would be at least the tensor's ``nbytes``."""
    return changed * (POS_WIDTH + element_size) >= nbytes


@dataclass
class Segment:
    """Tensors diffed as one region: ``names``/``tensors`` in region order, ``offsets`` (bytes from the
    region's start, multiples of 8), the region's ``words`` (int64, a view of the tensors' storage where it
    can be, else a padded copy) and ``key`` (what a snapshot must match to be this segment's base)."""

    names: list[str]
    tensors: list[torch.Tensor]
    offsets: list[int]
    words: torch.Tensor
    key: tuple = field(default=())


def _storage_bytes(t: torch.Tensor) -> tuple[int, int, int]:
    """``(storage pointer, byte offset of t in it, storage bytes)``."""
    st = t.untyped_storage()
    return st.data_ptr(), t.storage_offset() * t.element_size(), st.nbytes()


def segments(items: list[tuple[str, torch.Tensor]]) -> list[Segment]:
    """Group ``(name, contiguous tensor)`` pairs, in order, into :class:`Segment` regions (see the module
    docstring). Tensors that fit no region (not contiguous, not word-aligned, the last one of a storage
    whose bytes end mid-word) are segments of one, diffed as a padded copy of their words."""
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
    """One tensor's diff: ``changed`` values; ``dense`` (send it whole) or ``positions`` (int32, flat) and
    ``values`` (the new values there); ``parts``, its checksum parts after the update."""

    changed: int
    dense: bool
    parts: tuple[int, int]
    positions: torch.Tensor | None = None
    values: torch.Tensor | None = None


def seed_segment(seg: Segment, snapshot: torch.Tensor) -> list[tuple[int, int]]:
    """Copy ``seg``'s words into ``snapshot`` (host int64, same length) and return each tensor's checksum
    parts, in one read of the region."""
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
    """Parts of the tensor of ``nbytes`` bytes at word ``w0`` of ``words`` (its last word masked to its own
    bytes), copying its words into ``snapshot``."""
    whole = nbytes // 8
    parts = parts_and_copy(words[w0:w0 + whole], snapshot[w0:w0 + whole])
    rest = nbytes - whole * 8
    if rest:
        last = words[w0 + whole:w0 + whole + 1]
        snapshot[w0 + whole:w0 + whole + 1].copy_(last)
        masked = int(last.item()) & ((1 << (8 * rest)) - 1)
        parts = add_parts(parts, masked * (2 * whole + 1), masked)
    return parts


def diff_segment(seg: Segment, snapshot: torch.Tensor, old_parts: list[tuple[int, int]], pin: bool
                 ) -> list[TensorDiff | None]:
    """Diff ``seg`` against ``snapshot`` (host int64 words of the region as last published), bring the
    snapshot up to date, and return each tensor's :class:`TensorDiff` (``None``: unchanged).

    Reads the region's words and the snapshot once (on the tensors' device: the snapshot is copied there
    first when that is not host memory); large tensors decided dense are read once more while copied.
    """
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
    """Each tensor's checksum change ``(dW, dS)`` (int64, one per tensor) from the region's changed words
    ``widx`` (sorted) going from ``old_ws`` to ``new_ws``; tensor ``t`` holds words ``[w0_t, w1_t)``, its last
    word only up to its ``nbytes`` (the bytes past it are not its own)."""
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
    """How many of ``t``'s values differ from the snapshot ``old`` (int64 words, ``t`` at word ``w0``) if that
    many make it go dense, else ``None``, knowing ``words`` of its words differ (with one value per word that
    is the count; else a second read of ``t`` counts them)."""
    es = t.element_size()
    nbytes = t.numel() * es
    changed = words if per == 1 else count_ne(bits(t), bits(old.view(torch.uint8)[w0 * 8:w0 * 8 + nbytes].view(t.dtype)))
    return changed if goes_dense(changed, nbytes, es) else None


def ne(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a != b`` (bool) of integer tensors; on host memory through numpy (vectorized for every width)."""
    if a.device.type == "cpu":
        import numpy as np

        return torch.from_numpy(np.not_equal(a.numpy(), b.numpy()))
    return torch.ne(a, b)


def nonzero(mask: torch.Tensor) -> torch.Tensor:
    """The flat indices (int64, ascending) where the 1-D bool ``mask`` is set; on host memory through numpy
    (several times faster than torch's ``nonzero`` there when many are set). One host sync on a device."""
    if mask.device.type == "cpu":
        import numpy as np

        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return mask.nonzero().reshape(-1)


def take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x.index_select(0, index)`` for 1-D integer ``x``; on host memory through numpy."""
    if x.device.type == "cpu":
        import numpy as np

        return torch.from_numpy(np.take(x.numpy(), index.numpy()))
    return x.index_select(0, index)


def count_ne(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of the integer tensors ``a`` and ``b`` (same shape and device) differ. On host
    memory through numpy, whose comparisons of narrow integers are vectorized (torch's int16 ``ne`` runs
    several times slower than its int64 one there)."""
    if a.device.type == "cpu":
        import numpy as np

        return int(np.count_nonzero(np.not_equal(a.numpy(), b.numpy())))
    return int(torch.count_nonzero(torch.ne(a, b)))
