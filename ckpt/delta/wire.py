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
    """verl's per-flush checksum (``verl.checkpoint_engine.delta_sync.encode.checksum``), recomputed here.

    Args:
        positions: the uint8 positions blob, or ``None``/empty (a dense flush).
        values: the flush's values (any dtype; ``hash_tensor`` upcasts them to 64 bits before XOR).
    """
    p = int(torch.hash_tensor(positions).item()) if positions is not None and positions.numel() else 0
    v = int(torch.hash_tensor(values).item()) if values.numel() else 0
    return p ^ (v << 1)


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
