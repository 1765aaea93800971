"""verl 0.9.1's ``delta_flush`` wire format, as its rollout-side decoders read it.

One flush is a list of named tensors:

* ``__delta_spec__``: uint8 UTF-8 JSON ``{"encoding", "params", "checksum", ...}``; ``encoding`` is
  ``"indices"`` (int32 positions + values) or ``"dense"`` (values only: the seed, or a delta larger than its
  tensor); each ``params`` entry is a verl ``DeltaParam`` (``name, dtype, shape, pos_start, pos_end,
  pos_width, val_start, val_end``: byte offsets into positions, element offsets into values).
* ``__positions__`` (``indices`` only): little-endian int32 flat positions as a uint8 blob.
* ``__values__``: the values, one dtype per flush.
* ``checksum``: ``hash_tensor(positions) ^ (hash_tensor(values) << 1)`` (0 for an empty one), which verl and
  vLLM recompute and refuse on mismatch.

hal adds ``"hal"`` = ``{"step", "base_step", "flush", "checksums": {name: int}}`` (verl's decoders ignore it):
the :func:`ckpt.delta.checksum.tensor_checksum` each tensor must have after the flush, and the steps it
produces and applies onto (``None``: a seed). Through hal's engines flush ``k``'s tensors travel as
``__delta_flush__/<k>/<key>`` (:func:`wire_name`, :func:`split_wire_name`).
"""

from __future__ import annotations

import json
from typing import Any

import torch

SPEC = "__delta_spec__"
POSITIONS = "__positions__"
VALUES = "__values__"
KEYS = (SPEC, POSITIONS, VALUES)
WIRE_PREFIX = "__delta_flush__"
POS_WIDTH = 4  # int32 positions (verl's "indices" encoding)


def flush_checksum(positions: torch.Tensor | None, values: torch.Tensor) -> int:
    """Return verl's per-flush checksum, ``hash_tensor(positions) ^ (hash_tensor(values) << 1)`` (0 if empty)."""
    p = value_hash(positions) if positions is not None and positions.numel() else 0
    v = value_hash(values) if values.numel() else 0
    return p ^ (v << 1)


def _upcast_bf16(x: int) -> int:
    return ((x & 0x8000) << 48) | ((x & 0x3FFF) << 45) | (((x >> 14) & 1) * (0x780 << 52))


def _upcast_f16(x: int) -> int:
    return ((x & 0x8000) << 48) | ((x & 0x3FFF) << 42) | (((x >> 14) & 1) * (0x7F0 << 52))


def _upcast_f32(x: int) -> int:
    return ((x & 0x80000000) << 32) | ((x & 0x3FFFFFFF) << 29) | (((x >> 30) & 1) * (0x780 << 52))


_UPCAST = {  # dtype -> (exponent mask, mantissa mask, the bit-linear part of the upcast, its constant)
    torch.bfloat16: (0x7F80, 0x007F, _upcast_bf16, 0x380 << 52),
    torch.float16: (0x7C00, 0x03FF, _upcast_f16, 0x3F0 << 52),
    torch.float32: (0x7F800000, 0x007FFFFF, _upcast_f32, 0x380 << 52),
}
_SIGNED = {torch.int8: 8, torch.int16: 16, torch.int32: 32, torch.int64: 64}
_UNSIGNED = (torch.uint8, torch.float64)  # bool upcasts to 0/1 whatever its byte; no uint16-64 XOR in torch
_MASK64 = (1 << 64) - 1


def value_hash(tensor: torch.Tensor) -> int:
    """Return ``int(torch.hash_tensor(tensor))``: the XOR of the elements upcast to 64 bits, as uint64.

    On a contiguous host tensor with :mod:`ckpt.delta.kernel` built, computed on integer views without the
    upcast (the float widening is linear over bits plus a constant per normal value); subnormals and NaNs go
    through ``torch.hash_tensor``, as every other dtype and device.
    """
    from ckpt.delta import kernel

    lib = kernel.library() if tensor.is_cpu and tensor.is_contiguous() else None
    dtype = tensor.dtype
    if lib is not None and tensor.numel():
        if dtype in _UPCAST:
            exp_mask, mant_mask, linear, constant = _UPCAST[dtype]
            x, normal, odd, where = kernel.xor_values(lib, tensor, exp_mask, mant_mask)
            if odd <= kernel.ODD_CAP:  # the few subnormals and NaNs: torch's own upcast of just those
                h = linear(x) ^ (constant if normal & 1 else 0)
                if odd:
                    picked = tensor.reshape(-1).index_select(0, where)
                    h ^= linear(kernel.xor_values(lib, picked)[0]) ^ int(torch.hash_tensor(picked).item())
                return h & _MASK64
        elif dtype in _SIGNED:
            x = kernel.xor_values(lib, tensor)[0]
            width = _SIGNED[dtype]
            return (x - (1 << width) if x >> (width - 1) & 1 else x) & _MASK64
        elif dtype in _UNSIGNED:
            return kernel.xor_values(lib, tensor)[0]
    return int(torch.hash_tensor(tensor).item()) & _MASK64


def encode_spec(spec: dict[str, Any], device: torch.device | str) -> torch.Tensor:
    """Return ``spec`` as a ``__delta_spec__`` tensor (UTF-8 JSON, 1-D uint8) on ``device``."""
    data = bytearray(json.dumps(spec, separators=(",", ":")).encode())
    return torch.frombuffer(data, dtype=torch.uint8).to(device)


def decode_spec(tensor: torch.Tensor) -> dict[str, Any]:
    """Return the JSON object of a ``__delta_spec__`` tensor; ValueError for a corrupted spec."""
    data = bytes(tensor.detach().to("cpu").contiguous().view(torch.uint8).tolist())
    try:
        spec = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{SPEC} is not UTF-8 JSON ({len(data)} bytes): {exc}") from exc
    if not isinstance(spec, dict):
        raise ValueError(f"{SPEC} holds JSON {type(spec).__name__}, expected an object")
    return spec


def wire_name(flush: int, key: str) -> str:
    """Return the name flush ``flush``'s tensor ``key`` travels under through hal's engines."""
    return f"{WIRE_PREFIX}/{flush}/{key}"


def split_wire_name(name: str) -> tuple[int, str]:
    """Return ``(flush, key)`` of a :func:`wire_name`; ValueError for any other name."""
    prefix, _, rest = name.partition("/")
    index, _, key = rest.partition("/")
    if prefix != WIRE_PREFIX or not index.isdigit() or key not in KEYS:
        raise ValueError(f"tensor {name!r} is not a delta_flush tensor (expected '{WIRE_PREFIX}/<flush>/<key>' "
                         f"with key one of {KEYS}); was the update sent with wire_format='named_tensors'?")
    return int(index), key
