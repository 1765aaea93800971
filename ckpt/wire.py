"""The wire metadata of the one-to-many engines: one dataclass per tensor entry and per message, as JSON.

A transfer is a sequence of messages, each a :class:`WireMessage` followed by its data segments: a bucket
message (``entries`` in send order, laid out in a buffer of the sender's ``bucket_size`` bytes, and the
``segments`` moved), a chunk message (a slice of one tensor larger than a bucket), an end message, or an
abort. An entry or chunk with ``full_shape`` is a row part: rows ``[row_start, row_start + shape[0])`` of dim
0 of a tensor of ``full_shape``. Every message carries the sender's ``step`` and ``bucket_size``, so a
receiver knows the layout before any byte moves."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch

from ckpt.errors import CheckpointConfigError, TransferError

META_HEADER = 8  # Bytes of the little-endian length prefix of a record written into a tensor.


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Return the ``torch.dtype`` named ``name`` (``"bfloat16"``), else :class:`TransferError`."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise TransferError(f"metadata names an unknown dtype {name!r}")
    return dtype


@dataclasses.dataclass
class TensorEntry:
    """One tensor of a bucket message: ``offset`` in bytes into the receive buffer; ``full_shape`` for a row part."""

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
        """Bytes this entry adds to an encoded message."""
        return len(json.dumps(_record(self), separators=(",", ":"))) + 1


def _record(item: Any) -> dict[str, Any]:
    record = {f.name: getattr(item, f.name) for f in dataclasses.fields(item)}  # shallow: asdict deep-copies
    if record.get("full_shape") is None:
        record.pop("full_shape", None)
        record.pop("row_start", None)
    return record


def row_bytes(shape: list[int], itemsize: int) -> int:
    """Return the bytes of one dim-0 row of a tensor of ``shape`` (all of a 0-d one)."""
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
    full_shape: list[int] | None = None  # for a row part: the whole tensor's shape (shape is the part's)
    row_start: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def last(self) -> bool:
        return self.start + self.length == self.nbytes


@dataclasses.dataclass
class WireMessage:
    """One message's metadata (see the module overview).

    ``abort``: why the sender gave the update up; ``fatal``: the connections are dropped too; ``slot``: the
    receive slot a one-sided-write engine wrote into."""

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
        record = _record(self)
        record["entries"] = [_record(e) for e in self.entries]
        record["segments"] = [_record(s) for s in self.segments]
        if self.chunk is not None:
            record["chunk"] = _record(self.chunk)
        return record

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    @classmethod
    def from_dict(cls, record: Any) -> WireMessage:
        """Rebuild a message from :meth:`to_dict`'s form, else :class:`TransferError`."""
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
        """Parse :meth:`to_bytes`' output, else :class:`TransferError`."""
        try:
            record = json.loads(raw)
        except ValueError as exc:
            raise TransferError(f"corrupt checkpoint metadata: {exc}") from exc
        return cls.from_dict(record)

    def write(self, out: torch.Tensor) -> None:
        """Write the message into flat ``uint8`` ``out``: an 8-byte length, then the JSON.

        Raises :class:`CheckpointConfigError` when it does not fit (``meta_capacity`` too small)."""
        raw = self.to_bytes()
        if META_HEADER + len(raw) > out.numel():
            raise CheckpointConfigError(f"metadata record of {len(raw)} bytes exceeds meta_capacity={out.numel()}")
        host = torch.empty(META_HEADER + len(raw), dtype=torch.uint8)
        host[:META_HEADER] = torch.tensor([len(raw)], dtype=torch.int64).view(torch.uint8)
        host[META_HEADER:] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        out[:host.numel()].copy_(host)

    @classmethod
    def read(cls, buf: torch.Tensor) -> WireMessage:
        """Read a message written by :meth:`write`, else :class:`TransferError`."""
        host = buf.cpu()  # the tensor itself when it is already in host memory
        length = int(host[:META_HEADER].view(torch.int64).item())
        if not 0 < length <= host.numel() - META_HEADER:
            raise TransferError(f"corrupt checkpoint metadata: length {length} for a {host.numel()}-byte record")
        return cls.from_bytes(bytes(host[META_HEADER:META_HEADER + length].numpy()))


def check_bucket_size(sender: int, receiver: int, where: str) -> None:
    """Raise :class:`CheckpointConfigError` naming both sizes when ``sender != receiver``."""
    if sender != receiver:
        raise CheckpointConfigError(f"bucket_size mismatch on {where}: the sender lays the update out in buckets "
                                    f"of {sender} bytes, this receiver was built with bucket_size={receiver}; "
                                    "build both sides with the same bucket_size")
