"""What one rank of a sharded trainer publishes: a tensor it owns whole, or rows of one (a dim-0 shard).

FSDP2 shards every parameter on dim 0 (``torch.chunk`` semantics), so rank ``r`` holds a contiguous row range.
A multi-sender sender publishes a :class:`RowShard`, a ``DTensor`` placed ``Shard(0)`` on a 1-D mesh, or a
plain tensor only it publishes."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Iterator

import torch

from ckpt.base import named_tensors
from ckpt.errors import CheckpointConfigError


@dataclasses.dataclass(frozen=True)
class RowShard:
    """Rows ``[row_start, row_start + local.shape[0])`` (dim 0) of a tensor of ``full_shape`` (``rows`` may be 0)."""

    local: torch.Tensor
    row_start: int
    full_shape: tuple[int, ...]

    def checked(self, name: str) -> RowShard:
        """Return this shard after checking it is a row range of ``full_shape``, else :class:`CheckpointConfigError`."""
        full = tuple(int(d) for d in self.full_shape)
        local = self.local
        if not isinstance(local, torch.Tensor) or not full or local.dim() != len(full) \
                or tuple(local.shape[1:]) != full[1:] or isinstance(self.row_start, bool) \
                or not isinstance(self.row_start, int) or not 0 <= self.row_start <= full[0] - local.shape[0]:
            raise CheckpointConfigError(
                f"row shard of {name!r} must be rows [row_start, row_start + rows) of full_shape on dim 0, got "
                f"local {tuple(local.shape) if isinstance(local, torch.Tensor) else type(local).__name__}, "
                f"row_start {self.row_start!r}, full_shape {full}")
        return RowShard(local, self.row_start, full)


def dim0_rows(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """Return the rows ``[start, stop)`` that ``rank`` holds under FSDP2's dim-0 sharding."""
    chunk = -(-rows // world_size) if rows else 0
    start = min(rows, rank * chunk)
    return start, min(rows, start + chunk)


def as_row_shard(name: str, value: Any) -> RowShard | torch.Tensor:
    """Return ``value`` as a sender publishes it: a checked :class:`RowShard`, a ``DTensor`` made one, or a tensor.

    A ``Replicate()`` ``DTensor`` is published whole by mesh coordinate 0 only (``None`` elsewhere)."""
    if isinstance(value, RowShard):
        return value.checked(name)
    if not isinstance(value, torch.Tensor):
        raise CheckpointConfigError(f"weights must yield (str, torch.Tensor | ckpt.RowShard) pairs, got "
                                    f"({name!r}, {type(value).__name__})")
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # a torch built without distributed: no DTensor can exist
        return value
    if not isinstance(value, DTensor):
        return value
    mesh, placements = value.device_mesh, tuple(value.placements)
    coordinate = mesh.get_coordinate()
    if mesh.ndim != 1 or len(placements) != 1 or coordinate is None:
        raise CheckpointConfigError(f"DTensor {name!r} must be on a 1-D mesh this rank belongs to (FSDP2), got "
                                    f"mesh {mesh} with placements {placements}")
    placement = placements[0]
    if isinstance(placement, Replicate):
        return value.to_local() if coordinate[0] == 0 else None
    if not isinstance(placement, Shard) or placement.dim != 0:
        raise CheckpointConfigError(f"DTensor {name!r} must be placed Shard(0) (FSDP2) or Replicate(), got "
                                    f"{placement}")
    full = tuple(value.shape)
    start, stop = dim0_rows(full[0], mesh.size(), coordinate[0])
    local = value.to_local()
    if local.shape[0] != stop - start:  # FSDP2 pads nothing in to_local(); another layout would be wrong here
        raise CheckpointConfigError(f"DTensor {name!r}: rank {coordinate[0]} of {mesh.size()} holds "
                                    f"{local.shape[0]} rows, Shard(0) of {full[0]} rows gives {stop - start}")
    return RowShard(local, start, full).checked(name)


def local_parts(named: Iterable[tuple[str, Any]], rank: int, dtype: torch.dtype | None = None
                ) -> Iterator[tuple[str, RowShard | torch.Tensor]]:
    """Yield what trainer rank ``rank`` publishes from its ``state_dict().items()``, gathering nothing.

    Each ``DTensor``'s own rows, and plain tensors from rank 0 only. ``dtype``: floating-point values are cast
    to it (only this rank's rows)."""
    for name, value in named_tensors(named, accepted=()):
        part = as_row_shard(name, value)
        if part is None or (not isinstance(part, RowShard) and not _is_dtensor(value) and rank != 0):
            continue
        if dtype is not None:
            local = part.local if isinstance(part, RowShard) else part
            if local.is_floating_point() and local.dtype != dtype:
                local = local.to(dtype)
                part = RowShard(local, part.row_start, part.full_shape) if isinstance(part, RowShard) else local
        yield name, part


def _is_dtensor(value: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(value, DTensor)
