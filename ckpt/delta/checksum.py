"""Per-tensor checksums of raw bytes, computed on the tensor's own device and updated from changed values.

A tensor's bytes (row-major, zero-padded to a multiple of 8) are read as 64-bit words ``w_i`` (little
endian), and its checksum is the pair, each mod ``2**64``::

    W = sum(w_i * (2 i + 1))      S = sum(w_i)

(odd weights: changing any one word changes ``W``; swapping two different words changes it too, unless
their difference times twice their distance is a multiple of ``2**64``), packed into one 128-bit int by
:func:`combine`. ``torch.hash_tensor`` (an XOR of the elements upcast to 64 bits) would be blind to where a
value sits and, being nonlinear, could not be updated from the changed values alone.

Both parts are linear in the words, so a side that knows which elements changed, and their old and new
bits, updates the checksum without reading the rest (:func:`element_delta`): the sender from its diff, the
rollout from the positions it writes. A full computation (:func:`word_parts`, the seed's) is one read:
on host memory one C loop (:mod:`ckpt.delta.kernel`, where built), else the words are reduced in
cache-sized blocks ``[rows, K]`` whose row sums and column sums give ``W``; with :func:`parts_and_copy` the
same read also copies the bytes (the snapshot update, a dense write).
"""

from __future__ import annotations

import torch

K = 512
"""Words per row of the blocked reduction."""
BLOCK_ROWS = 256
"""Rows per block (``K * BLOCK_ROWS * 8`` bytes = 1 MiB: a block stays in cache between its two reductions)."""
_MASK64 = (1 << 64) - 1
_CONSTS: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def raw_words(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes (row-major) as a 1-D int64 tensor on its device, zero-padded to a multiple of 8.

    A view when ``tensor`` is contiguous, starts on an 8-byte boundary of its storage and has a multiple of
    8 bytes; else a copy.
    """
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (-raw.numel()) % 8
    if pad:
        raw = torch.cat([raw, torch.zeros(pad, dtype=torch.uint8, device=raw.device)])
    elif raw.storage_offset() % 8:
        raw = raw.clone()
    return raw.view(torch.int64)


def _consts(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(2 k + 1 for k < K, r for r < BLOCK_ROWS)`` on ``device`` (int64, cached per device)."""
    key = str(device)
    cached = _CONSTS.get(key)
    if cached is None or cached[0].device != device:
        cached = _CONSTS[key] = (torch.arange(K, dtype=torch.int64, device=device) * 2 + 1,
                                 torch.arange(BLOCK_ROWS, dtype=torch.int64, device=device))
    return cached


def parts_and_copy(words: torch.Tensor, out: torch.Tensor | None = None) -> tuple[int, int]:
    """``(W, S)`` of 1-D int64 ``words`` (see the module docstring); with ``out`` (int64, same length, any
    device) also copies ``words`` into ``out``, block by block while each block is in cache. One host sync.

    With ``i = b * R * K + r * K + k`` (block ``b`` of ``R = BLOCK_ROWS`` rows of ``K`` words),
    ``sum(w_i (2 i + 1)) = sum_k (2 k + 1) C_k + 2 K sum_b sum_r (b R + r) Rsum_br`` with ``C`` the column sums
    over all blocks and ``Rsum`` the row sums: two reductions of each block, no product the size of ``words``.
    """
    n = words.numel()
    if out is not None and out.numel() != n:
        raise ValueError(f"out has {out.numel()} words, words has {n}")
    if n == 0:
        return 0, 0
    if words.is_cpu and words.is_contiguous() and (
            out is None or (out.is_cpu and out.is_contiguous())):
        from ckpt.delta import kernel

        lib = kernel.library()
        if lib is not None:  # one loop: read, copy, sum (see ckpt.delta.kernel)
            import numpy as np

            rows = np.zeros((1, kernel.ROW), dtype=np.int64)
            rows[0, kernel.NBYTES] = 8 * n
            kernel.seed(lib, words, out, 8, rows)
            return int(rows[0, kernel.DW]) & _MASK64, int(rows[0, kernel.DS]) & _MASK64
    dev = words.device
    wk, rows_idx = _consts(dev)
    block = K * BLOCK_ROWS
    full = n // K * K
    cols = torch.zeros(K, dtype=torch.int64, device=dev)
    w_rows = torch.zeros((), dtype=torch.int64, device=dev)  # sum over rows of global_row * row_sum
    s = torch.zeros((), dtype=torch.int64, device=dev)
    same = out is not None and out.device == dev
    for start in range(0, full, block):
        stop = min(start + block, full)
        x = words[start:stop].view(-1, K)
        # .to(dev): a no-op, except on the simulated npu, whose dim reductions land on the current device
        rsum = x.sum(1).to(dev)
        cols += x.sum(0).to(dev)
        w_rows += (rsum * (rows_idx[:rsum.numel()] + start // K)).sum()
        s += rsum.sum()
        if same:
            out[start:stop].copy_(words[start:stop])
    w = (cols * wk).sum() + 2 * K * w_rows
    if full < n:
        tail = words[full:]
        w += (tail * (torch.arange(full, n, dtype=torch.int64, device=dev) * 2 + 1)).sum()
        s += tail.sum()
    if out is not None:
        if same:
            out[full:].copy_(words[full:])
        else:
            out.copy_(words)
    both = torch.stack([w, s]).tolist()
    return both[0] & _MASK64, both[1] & _MASK64


def word_parts(words: torch.Tensor) -> tuple[int, int]:
    """``(W, S)`` of 1-D int64 ``words`` (see the module docstring): one read, one host sync."""
    return parts_and_copy(words)


_LANE_MASK = {1: 0xFF, 2: 0xFFFF, 4: 0xFFFFFFFF}
_LANE_SCALE: dict[tuple[str, int], torch.Tensor] = {}


def element_delta(positions: torch.Tensor, old: torch.Tensor, new: torch.Tensor, element_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """What a tensor's checksum parts ``(W, S)`` change by (two 0-dim int64 tensors, mod ``2**64``) when its
    elements at flat ``positions`` (int64, each once) change from the raw bits ``old`` to ``new`` (integer
    tensors of ``element_size`` bytes, e.g. :func:`ckpt.delta.diff.bits` views).

    Element ``p`` is lane ``p % per`` of word ``p // per`` (``per = 8 // element_size``, little endian), so
    the word changes by ``(new - old) << (8 * element_size * lane)``, lane values taken unsigned.
    """
    per = 8 // element_size
    if per == 1:
        d = new.to(torch.int64) - old.to(torch.int64)
        word = positions
    else:
        mask = _LANE_MASK[element_size]
        d = new.to(torch.int64).bitwise_and_(mask).sub_(old.to(torch.int64).bitwise_and_(mask))
        key = (str(positions.device), element_size)
        scale = _LANE_SCALE.get(key)
        if scale is None or scale.device != positions.device:
            scale = _LANE_SCALE[key] = torch.tensor([1 << (8 * element_size * lane) for lane in range(per)],
                                                    dtype=torch.int64, device=positions.device)
        d.mul_(scale.index_select(0, positions & (per - 1)))
        word = positions >> (per.bit_length() - 1)
    ds = d.sum()
    return (d * word).sum() * 2 + ds, ds


def add_parts(parts: tuple[int, int], dw: int, ds: int) -> tuple[int, int]:
    """``parts`` plus ``(dw, ds)``, mod ``2**64``."""
    return (parts[0] + dw) & _MASK64, (parts[1] + ds) & _MASK64


def combine(parts: tuple[int, int]) -> int:
    """The 128-bit checksum (Python int) of ``(W, S)`` parts."""
    return ((parts[0] & _MASK64) << 64) | (parts[1] & _MASK64)


def tensor_parts(tensor: torch.Tensor) -> tuple[int, int]:
    """``(W, S)`` of ``tensor``'s raw bytes (a copy first only when it is not word-aligned, see :func:`raw_words`)."""
    return word_parts(raw_words(tensor))


def tensor_checksum(tensor: torch.Tensor) -> int:
    """A 128-bit checksum (Python int) of ``tensor``'s raw bytes, computed on its device.

    Equal bytes (any dtype, NaN payloads and signed zeros included) give equal checksums; the shape is
    not hashed (callers check it). Cost: one read of the tensor (a copy first when it does not start on
    an 8-byte boundary or its bytes are no multiple of 8); one host sync.
    """
    return combine(tensor_parts(tensor))
