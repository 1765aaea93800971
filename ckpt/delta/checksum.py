"""Per-tensor checksums of raw bytes, computed on the tensor's own device.

``torch.hash_tensor`` (torch >= 2.10) XOR-reduces the elements after upcasting them to 64 bits: cheap, but
blind to where a value sits (two swapped words hash alike) and, for floating dtypes, to NaN payload bits
lost in the upcast. :func:`tensor_checksum` hashes the raw bytes instead, as 64-bit words ``w_i``, with
two device reductions: ``torch.hash_tensor`` of the words (XOR) and a position-weighted sum
``sum(w_i * (2 i + 1)) mod 2**64`` (odd weights: changing any one word, or swapping two different words,
changes the sum). Both are updated word by word (:func:`updated_parts`), so a sender that knows which
words changed gets the new checksum without reading the rest. Only 64-bit results cross to Python.
"""

from __future__ import annotations

import torch

#: words per chunk of the weighted sum (bounds its transient: the weights are cached per device)
CHUNK_WORDS = 1 << 20
_MASK64 = (1 << 64) - 1
_WEIGHTS: dict[str, torch.Tensor] = {}


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


def _weights(device: torch.device) -> torch.Tensor:
    """``2 i + 1`` for ``i < CHUNK_WORDS`` on ``device`` (int64, cached)."""
    key = str(device)
    if key not in _WEIGHTS:
        _WEIGHTS[key] = torch.arange(CHUNK_WORDS, dtype=torch.int64, device=device) * 2 + 1
    return _WEIGHTS[key]


def word_parts(words: torch.Tensor) -> tuple[int, int]:
    """``(weighted sum mod 2**64, XOR)`` of 1-D int64 ``words`` (see the module docstring)."""
    if words.numel() == 0:
        return 0, 0
    xor = int(torch.hash_tensor(words).item()) & _MASK64
    weights = _weights(words.device)
    acc = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), CHUNK_WORDS):
        chunk = words[start:start + CHUNK_WORDS]
        # int64 arithmetic wraps, so this is the sum mod 2**64; chunk k's weights are 2 (start + i) + 1
        acc += (chunk * weights[:chunk.numel()]).sum() + 2 * start * chunk.sum()
    return int(acc.item()) & _MASK64, xor


def updated_parts(parts: tuple[int, int], index: torch.Tensor, old: torch.Tensor, new: torch.Tensor
                  ) -> tuple[int, int]:
    """The parts of a word tensor after its words at ``index`` (int64) changed from ``old`` to ``new``."""
    if index.numel() == 0:
        return parts
    wsum = int(((new - old) * (index * 2 + 1)).sum().item())
    xor = int(torch.hash_tensor(old ^ new).item())
    return (parts[0] + wsum) & _MASK64, (parts[1] ^ xor) & _MASK64


def combine(parts: tuple[int, int]) -> int:
    """The 128-bit checksum (Python int) of ``(weighted sum, XOR)`` parts."""
    return (parts[0] << 64) | parts[1]


def tensor_checksum(tensor: torch.Tensor) -> int:
    """A 128-bit checksum (Python int) of ``tensor``'s raw bytes, computed on its device.

    Equal bytes (any dtype, NaN payloads and signed zeros included) give equal checksums; the shape is
    not hashed (callers check it). Cost: about three passes over the tensor; two host syncs.
    """
    return combine(word_parts(raw_words(tensor)))
