"""Per-tensor checksums of raw bytes, computed on the tensor's own device and updated from changed values.

A tensor's bytes (zero-padded to a multiple of 8) are little-endian 64-bit words ``w_i``; its checksum is,
mod ``2**64``, ``W = sum(w_i * (2 i + 1))`` and ``S = sum(w_i)``, packed by :func:`combine` into 128 bits.
Unlike ``torch.hash_tensor`` it sees where a value sits, and being linear it updates from the changed
elements alone (:func:`element_delta`). A full computation (:func:`word_parts`) is one read: a C loop on host
memory (:mod:`ckpt.delta.kernel`), else blocked row/column sums; :func:`parts_and_copy` also copies.
"""

from __future__ import annotations

import torch

# Words per row of the blocked reduction.
K = 512
# Rows per block (K * BLOCK_ROWS * 8 bytes = 1 MiB stays in cache between its two reductions).
BLOCK_ROWS = 256
_MASK64 = (1 << 64) - 1
_CONSTS: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def raw_words(tensor: torch.Tensor) -> torch.Tensor:
    """Return ``tensor``'s bytes as 1-D int64 on its device, zero-padded (a view when aligned, else a copy)."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (-raw.numel()) % 8
    if pad:
        raw = torch.cat([raw, torch.zeros(pad, dtype=torch.uint8, device=raw.device)])
    elif raw.storage_offset() % 8:
        raw = raw.clone()
    return raw.view(torch.int64)


def _consts(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(2 k + 1 for k < K, r for r < BLOCK_ROWS)`` on ``device`` (int64, cached per device)."""
    key = str(device)
    cached = _CONSTS.get(key)
    if cached is None or cached[0].device != device:
        cached = _CONSTS[key] = (torch.arange(K, dtype=torch.int64, device=device) * 2 + 1,
                                 torch.arange(BLOCK_ROWS, dtype=torch.int64, device=device))
    return cached


def parts_and_copy(words: torch.Tensor, out: torch.Tensor | None = None) -> tuple[int, int]:
    """Return ``(W, S)`` of 1-D int64 ``words``; with ``out`` also copy ``words`` into it while in cache.

    ``W`` comes from per-block column sums ``C`` and row sums: ``sum_k (2 k + 1) C_k + 2 K sum_b sum_r (b R + r)
    Rsum_br``. One host sync.
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
    """Return ``(W, S)`` of 1-D int64 ``words``: one read, one host sync."""
    return parts_and_copy(words)


_LANE_MASK = {1: 0xFF, 2: 0xFFFF, 4: 0xFFFFFFFF}
_LANE_SCALE: dict[tuple[str, int], torch.Tensor] = {}


def element_delta(positions: torch.Tensor, old: torch.Tensor, new: torch.Tensor, element_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the change of ``(W, S)`` (two 0-dim int64) when elements at ``positions`` go from bits ``old`` to ``new``.

    Element ``p`` is lane ``p % per`` of word ``p // per`` (``per = 8 // element_size``), so the word changes
    by ``(new - old) << (8 * element_size * lane)``, lanes unsigned.
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
    """Return ``parts`` plus ``(dw, ds)``, mod ``2**64``."""
    return (parts[0] + dw) & _MASK64, (parts[1] + ds) & _MASK64


def combine(parts: tuple[int, int]) -> int:
    """Return the 128-bit checksum of ``(W, S)`` parts."""
    return ((parts[0] & _MASK64) << 64) | (parts[1] & _MASK64)


def tensor_parts(tensor: torch.Tensor) -> tuple[int, int]:
    """Return ``(W, S)`` of ``tensor``'s raw bytes."""
    return word_parts(raw_words(tensor))


def tensor_checksum(tensor: torch.Tensor) -> int:
    """Return a 128-bit checksum of ``tensor``'s raw bytes (NaN payloads and signed zeros included), on its device.

    The shape is not hashed. One read (a copy first when unaligned); one host sync.
    """
    return combine(tensor_parts(tensor))
