"""Per-tensor checksums of raw bytes, computed on the tensor's own device.

``torch.hash_tensor`` (torch >= 2.10) XOR-reduces the elements after upcasting them to 64 bits: cheap, but
blind to where a value sits (two swapped words hash alike) and, for floating dtypes, to NaN payload bits
lost in the upcast. :func:`tensor_checksum` hashes the raw bytes instead, as 64-bit words, with two device
reductions: ``torch.hash_tensor`` of the words and a position-weighted sum ``sum(w_i * (2 i + 1)) mod 2**64``
(odd weights: changing any one word, or swapping two different words, changes the sum). Both run where the
tensor lives (GPU, NPU, host) and only the two 64-bit results cross to Python.
"""

from __future__ import annotations

import torch

#: words per chunk of the weighted sum (bounds its transient at 16 bytes per word of one chunk)
CHUNK_WORDS = 1 << 22
_MASK64 = (1 << 64) - 1


def raw_words(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes (row-major) as a 1-D int64 tensor on its device, zero-padded to a multiple of 8.

    A view when ``tensor`` is contiguous and its byte count is a multiple of 8, else a copy.
    """
    flat = tensor.detach().contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.element_size() > 1 or flat.dtype != torch.uint8 else flat
    pad = (-raw.numel()) % 8
    if pad:
        raw = torch.cat([raw, torch.zeros(pad, dtype=torch.uint8, device=raw.device)])
    return raw.view(torch.int64)


def tensor_checksum(tensor: torch.Tensor) -> int:
    """A 128-bit checksum (Python int) of ``tensor``'s raw bytes, computed on its device.

    Equal bytes (any dtype, NaN payloads and signed zeros included) give equal checksums; the shape is
    not hashed (callers check it). Cost: two reductions over the tensor plus, per chunk of
    :data:`CHUNK_WORDS` words, an int64 weight vector; two host syncs.
    """
    words = raw_words(tensor)
    if words.numel() == 0:
        return 0
    xor = int(torch.hash_tensor(words).item())
    acc = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), CHUNK_WORDS):
        chunk = words[start:start + CHUNK_WORDS]
        weights = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=words.device) * 2 + 1
        acc += (chunk * weights).sum()  # int64 arithmetic wraps: the sum is taken mod 2**64
    return ((int(acc.item()) & _MASK64) << 64) | (xor & _MASK64)
