"""Delta weight sync in verl 0.9.1's ``delta_flush`` wire format, over any hal checkpoint engine.

After a few RL steps only a few percent of the published bf16 values change per step; sending those as
int32 positions plus values (verl's ``delta_sharded`` engine, CUDA-only there) cuts the bytes on the wire.
Here it is a layer over engines that carry named tensors, so it runs unchanged on NCCL, HCCL and gloo
(the collective engine), the file engine, and any other:

* :class:`DeltaSender` (trainer): a host snapshot of the last published values; each update diffed on the
  device bit-wise (NaN and signed zero round-trip), yielding verl's ``(named_tensors, is_last)`` flushes;
  a full seed first, after :meth:`~DeltaSender.reseed`, and after an update not delivered.
* :class:`DeltaReceiver` / :func:`apply_delta_flush` (rollout): applies flushes onto a model's own tensors,
  atomic or in place, checking verl's flush checksum and hal's per-tensor checksum of the result
  (carried in the spec JSON under ``"hal"``, a key verl's decoders ignore).
* :func:`delta_send`, :func:`receive_delta_flushes`, :func:`receive_delta`: the engine-side glue;
  :class:`DeltaCheckpointEngine` / :func:`delta_engine_class`: the same as an engine of
  ``wire_format = "delta_flush"`` (for verl's registry and rollout adapters).

Modules: ``wire`` (the format), ``checksum``, ``diff`` (the sender's diff), ``kernel`` (its host-memory
loops in C, built once, with torch/numpy paths giving the same bits where no compiler is found),
``sender``, ``receiver``, ``transport``, ``engine``, ``errors``.
"""

from ckpt.delta.checksum import tensor_checksum
from ckpt.delta.engine import DeltaCheckpointEngine, delta_engine_class
from ckpt.delta.errors import DeltaBaseError, DeltaChecksumError, DeltaRefusedError
from ckpt.delta.receiver import DeltaReceiver, apply_delta_flush
from ckpt.delta.sender import DeltaSender, UpdateStats
from ckpt.delta.transport import delta_send, receive_delta, receive_delta_flushes, wire_tensors
from ckpt.delta.wire import flush_checksum

WIRE_FORMAT = "delta_flush"

__all__ = [
    "WIRE_FORMAT", "DeltaSender", "UpdateStats", "DeltaReceiver", "apply_delta_flush", "delta_send",
    "receive_delta", "receive_delta_flushes", "wire_tensors", "tensor_checksum", "flush_checksum",
    "DeltaRefusedError", "DeltaChecksumError", "DeltaBaseError", "DeltaCheckpointEngine", "delta_engine_class",
]
