"""The wire metadata of the one-to-many engines: one dataclass per tensor entry and per message, encoded in
one place (JSON with named fields).

A transfer is a sequence of messages, each one :class:`WireMessage` followed by its data segments:

* a **bucket** message: ``entries`` (one :class:`TensorEntry` per tensor, in send order) laid out in a
  receive buffer of the sender's ``bucket_size`` bytes, and ``segments``, the byte ranges that are moved;
* a **chunk** message: a slice of the bytes of one tensor larger than a bucket (:class:`Chunk`);
* an **end** message closing the update, or an **abort** message when the sender failed mid-update.

A tensor entry or chunk may be a **row part** (:attr:`TensorEntry.full_shape` set): rows
``[row_start, row_start + shape[0])`` of dim 0 of a tensor of ``full_shape``, as one rank of a sharded trainer
holds it (FSDP2's dim-0 shard is a contiguous row range of the full tensor). Its ``shape`` is the part's own
(``full_shape`` with ``shape[0]`` rows), so a part lands contiguously in the full tensor at byte
``row_start * row_bytes``. Whole tensors leave both fields out of the encoding.

Every message carries the sender's ``step`` (``global_steps``) and ``bucket_size``, so a receiver knows the
sender's layout before any byte moves (it adopts it, or refuses a mismatch with
:class:`~ckpt.errors.CheckpointConfigError` naming both sizes).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch

from ckpt.errors import CheckpointConfigError, TransferError

META_HEADER = 8
"""Bytes of the little-endian length prefix of a record written into a tensor (:meth:`WireMessage.write`)."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``.

    Raises:
        TransferError: ``name`` is not a torch dtype (corrupt or foreign metadata).
    """
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise TransferError(f"metadata names an unknown dtype {name!r}")
    return dtype


@dataclasses.dataclass
class TensorEntry:
    """One tensor of a bucket message.

    Attributes:
        name: the tensor's name.
        dtype: its dtype's name (``"bfloat16"``); :attr:`torch_dtype` gives the ``torch.dtype``.
        shape: its shape.
        offset: bytes from the start of the receive buffer (aligned for ``dtype``).
        nbytes: ``numel * itemsize``.
        full_shape: for a row part (see the module docstring), the whole tensor's shape; ``None``: the entry
            is the whole tensor.
        row_start: for a row part, its first row in the whole tensor (dim 0); 0 otherwise.
    """

    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int
    full_shape: list[int] | None = None
    row_start: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    def encoded_size(self) -> int:
        """Bytes this entry adds to an encoded message (its JSON and a separator)."""
        return len(json.dumps(_record(self), separators=(",", ":"))) + 1


def _record(item: Any) -> dict[str, Any]:
    """An entry's or chunk's fields as a dict, without the row-part fields when it is a whole tensor."""
    record = dataclasses.asdict(item)
    if record.get("full_shape") is None:
        record.pop("full_shape", None)
        record.pop("row_start", None)
    return record


def row_bytes(shape: list[int], itemsize: int) -> int:
    """Bytes of one dim-0 row of a tensor of ``shape`` (the whole tensor for a 0-d one)."""
    n = itemsize
    for d in shape[1:]:
        n *= d
    return n


@dataclasses.dataclass(frozen=True)
class Segment:
    """A byte range ``[offset, offset + nbytes)`` of the receive buffer (or of a chunk) that is moved."""

    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Bytes ``[start, start + length)`` of a tensor ``name`` of ``nbytes`` bytes, larger than a bucket."""

    name: str
    dtype: str
    shape: list[int]
    nbytes: int
    start: int
    length: int
    full_shape: list[int] | None = None
    """For a row part: the whole tensor's shape (``shape`` is the part's); ``None``: a whole tensor."""
    row_start: int = 0
    """For a row part: its first row in the whole tensor."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def last(self) -> bool:
        """Whether this chunk completes its tensor."""
        return self.start + self.length == self.nbytes


@dataclasses.dataclass
class WireMessage:
    """One message's metadata (see the module docstring).

    Attributes:
        step: the sender's ``global_steps`` (``None``: untagged).
        bucket_size: the sender's bucket size in bytes (what the receiver's layout must match).
        entries, segments: a bucket message's tensors and moved byte ranges.
        chunk: a chunk message's slice.
        end: the update is complete.
        abort: why the sender gave the update up (``None``: it did not).
        fatal: with ``abort``: the connections are dropped (a peer failed), not just this update.
        slot: where a one-sided-write engine wrote the data (its receive slot), ``None`` elsewhere.
    """

    step: int | None
    bucket_size: int
    entries: list[TensorEntry] = dataclasses.field(default_factory=list)
    segments: list[Segment] = dataclasses.field(default_factory=list)
    chunk: Chunk | None = None
    end: bool = False
    abort: str | None = None
    fatal: bool = False
    slot: int | None = None

    def to_dict(self) -> dict[str, Any]:
        record = dataclasses.asdict(self)
        record["entries"] = [_record(e) for e in self.entries]
        if self.chunk is not None:
            record["chunk"] = _record(self.chunk)
        return record

    def to_bytes(self) -> bytes:
        """The message as compact JSON (named fields)."""
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    @classmethod
    def from_dict(cls, record: Any) -> WireMessage:
        """Rebuild a message from :meth:`to_dict`'s form.

        Raises:
            TransferError: the record is not a message (corrupt or foreign metadata).
        """
        try:
            chunk = record.get("chunk")
            return cls(step=record["step"], bucket_size=record["bucket_size"],
                       entries=[TensorEntry(**e) for e in record.get("entries", [])],
                       segments=[Segment(**s) for s in record.get("segments", [])],
                       chunk=Chunk(**chunk) if chunk is not None else None, end=bool(record.get("end", False)),
                       abort=record.get("abort"), fatal=bool(record.get("fatal", False)), slot=record.get("slot"))
        except (AttributeError, KeyError, TypeError) as exc:
            raise TransferError(f"corrupt checkpoint metadata (not a message: {type(exc).__name__}: {exc}): "
                                f"{str(record)[:300]}") from exc

    @classmethod
    def from_bytes(cls, raw: bytes) -> WireMessage:
        """Parse :meth:`to_bytes`' output.

        Raises:
            TransferError: not JSON, or not a message.
        """
        try:
            record = json.loads(raw)
        except ValueError as exc:
            raise TransferError(f"corrupt checkpoint metadata: {exc}") from exc
        return cls.from_dict(record)

    def write(self, out: torch.Tensor) -> None:
        """Write the message into ``out`` (flat ``uint8``, any device): 8-byte length, then the JSON.

        Raises:
            CheckpointConfigError: it does not fit ``out`` (``meta_capacity`` too small).
        """
        raw = self.to_bytes()
        if META_HEADER + len(raw) > out.numel():
            raise CheckpointConfigError(f"metadata record of {len(raw)} bytes exceeds meta_capacity={out.numel()}")
        host = torch.empty(META_HEADER + len(raw), dtype=torch.uint8)
        host[:META_HEADER] = torch.tensor([len(raw)], dtype=torch.int64).view(torch.uint8)
        host[META_HEADER:] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        out[:host.numel()].copy_(host)

    @classmethod
    def read(cls, buf: torch.Tensor) -> WireMessage:
        """Read a message written by :meth:`write`.

        Raises:
            TransferError: the length, the JSON or the record is corrupt.
        """
        host = buf.cpu()  # the tensor itself when it is already in host memory
        length = int(host[:META_HEADER].view(torch.int64).item())
        if not 0 < length <= host.numel() - META_HEADER:
            raise TransferError(f"corrupt checkpoint metadata: length {length} for a {host.numel()}-byte record")
        return cls.from_bytes(bytes(host[META_HEADER:META_HEADER + length].numpy()))


def check_bucket_size(sender: int, receiver: int, where: str) -> None:
    """Refuse an update laid out for another bucket size than the receiver's buffers.

    Raises:
        CheckpointConfigError: ``sender != receiver``; names both sizes (bytes) and ``where``.
    """
    if sender != receiver:
        raise CheckpointConfigError(f"bucket_size mismatch on {where}: the sender lays the update out in buckets "
                                    f"of {sender} bytes, this receiver was built with bucket_size={receiver}; "
                                    "build both sides with the same bucket_size")
