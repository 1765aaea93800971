"""Delta weight sync in verl 0.9.1's ``delta_flush`` wire format, over any hal checkpoint engine.

Only a few percent of bf16 values change per RL step, so an update goes as int32 positions plus values.
:class:`DeltaSender` (trainer) diffs each update bit-wise on the device against a host snapshot of the last
published values and yields verl's ``(named_tensors, is_last)`` flushes (a full seed first, after
:meth:`~DeltaSender.reseed`, and after an update not delivered). :class:`DeltaReceiver` /
:func:`apply_delta_flush` (rollout) apply flushes, atomic or in place, checking verl's flush checksum and
hal's per-tensor one. :func:`delta_send`, :func:`receive_delta_flushes`, :func:`receive_delta` and
:class:`DeltaCheckpointEngine` carry the flushes over any engine of named tensors.
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
