"""verl 0.9.1's ``delta_flush`` wire format, as its rollout-side decoders read it.

One flush is a list of named tensors (verl ``CheckpointEngine.wire_format = "delta_flush"``; the engine's
``receive_weights`` yields ``(named_tensors, is_last)``):

* ``__delta_spec__``: uint8 tensor of a UTF-8 JSON object ``{"encoding", "params", "checksum", ...}``;
  ``encoding`` is ``"indices"`` (int32 positions + values) or ``"dense"`` (values only: the seed, and any
  tensor whose delta would be larger than itself); each entry of ``params`` is a verl ``DeltaParam``
  (``name, dtype, shape, pos_start, pos_end, pos_width, val_start, val_end``: byte offsets into the
  positions blob, element offsets into the values).
* ``__positions__`` (``indices`` only): uint8 blob of little-endian int32 flat positions, 4 bytes each.
* ``__values__``: the values, all of one dtype per flush.
* ``checksum``: verl's ``hash_tensor(positions) ^ (hash_tensor(values) << 1)`` (0 for an empty argument),
  which verl's ``delta_loader.apply_delta`` and vLLM consumer recompute and refuse on mismatch.

hal adds one key to the JSON that verl's decoders do not read (they read only the keys above, plus
``verify``/``is_last`` on dense flushes): ``"hal"`` = ``{"step", "base_step", "flush", "checksums": {name:
int}}``, the per-tensor :func:`ckpt.delta.checksum.tensor_checksum` of what each tensor must hold after
the flush is applied, the step the flush produces and the step it applies onto (``None``: a seed).

Over hal's engines, which carry plain ``(name, tensor)`` pairs and want names unique within an update (the
file engine keys a safetensors file by them), flush ``k``'s tensors travel as ``__delta_flush__/<k>/<key>``
(:func:`wire_name`); :func:`split_wire_name` gives ``(k, key)`` back.
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
    """verl's per-flush checksum (``verl.checkpoint_engine.delta_sync.encode.checksum``), recomputed here:
    ``hash_tensor(positions) ^ (hash_tensor(values) << 1)``, each term 0 for an empty argument.

    Args:
        positions: the uint8 positions blob, or ``None``/empty (a dense flush).
        values: the flush's values (any dtype; ``hash_tensor`` upcasts them to 64 bits before XOR).

    Returns:
        the same int verl computes (:func:`value_hash` of each, without the float64 upcast on host memory).
    """
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
    """``int(torch.hash_tensor(tensor))`` (an unsigned 64-bit int): the XOR of the elements, each upcast to
    its 64-bit float or integer equivalent and read as uint64 (torch's documented ``mode=0``).

    On a contiguous host tensor with :mod:`ckpt.delta.kernel` built, computed on integer views in one read,
    without the upcast: integers are sign- or zero-extended, and extension commutes with XOR; a float64's
    bits are its own. bfloat16, float16 and float32 widen to float64 by a map that is linear over bits for
    every value whose exponent field is neither all zeros nor all ones (the exponent's top bit becomes 4 or
    3 bits, its other bits and the mantissa move over, IEEE 754 binary64), plus a constant per such value;
    zeros and infinities follow the same linear part without the constant; so the hash is the linear part
    of the elements' XOR, the constant if an odd number of them are normal. Subnormals and NaNs (whose
    payload the upcast may change: x86 sets the quiet bit) are picked out and hashed by ``torch.hash_tensor``
    (all of them when there are more than :data:`ckpt.delta.kernel.ODD_CAP`), as is every other dtype and
    device.
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
    """The ``__delta_spec__`` tensor: ``spec`` as UTF-8 JSON in a 1-D uint8 tensor on ``device``."""
    data = bytearray(json.dumps(spec, separators=(",", ":")).encode())
    return torch.frombuffer(data, dtype=torch.uint8).to(device)


def decode_spec(tensor: torch.Tensor) -> dict[str, Any]:
    """The JSON object of a ``__delta_spec__`` tensor (any device).

    Raises:
        ValueError: not UTF-8 JSON of an object (a corrupted spec).
    """
    data = bytes(tensor.detach().to("cpu").contiguous().view(torch.uint8).tolist())
    try:
        spec = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{SPEC} is not UTF-8 JSON ({len(data)} bytes): {exc}") from exc
    if not isinstance(spec, dict):
        raise ValueError(f"{SPEC} holds JSON {type(spec).__name__}, expected an object")
    return spec


def wire_name(flush: int, key: str) -> str:
    """The name flush ``flush``'s tensor ``key`` (one of :data:`KEYS`) travels under through hal's engines."""
    return f"{WIRE_PREFIX}/{flush}/{key}"


def split_wire_name(name: str) -> tuple[int, str]:
    """``(flush, key)`` of a name made by :func:`wire_name`.

    Raises:
        ValueError: ``name`` is not such a name (the update was not sent in the delta wire format).
    """
    prefix, _, rest = name.partition("/")
    index, _, key = rest.partition("/")
    if prefix != WIRE_PREFIX or not index.isdigit() or key not in KEYS:
        raise ValueError(f"tensor {name!r} is not a delta_flush tensor (expected '{WIRE_PREFIX}/<flush>/<key>' "
                         f"with key one of {KEYS}); was the update sent with wire_format='named_tensors'?")
    return int(index), key
