"""What one rank of a sharded trainer publishes: a tensor it owns whole, or rows of one (a dim-0 shard).

FSDP2 shards every parameter on dim 0 (``Shard(0)``, ``torch.chunk`` semantics: chunks of
``ceil(rows / world)`` rows, the trailing ranks' possibly shorter or empty), so rank ``r`` holds a contiguous
row range of the full tensor. A sender in a multi-sender group (:mod:`ckpt.multi_sender`) publishes
``(name, value)`` pairs where ``value`` is

* a :class:`RowShard` (``local``, ``row_start``, ``full_shape``): rows ``[row_start, row_start +
  local.shape[0])`` of the tensor ``name`` of ``full_shape``;
* a ``DTensor`` placed ``Shard(0)`` on a 1-D mesh (FSDP2's parameters as they are): its local shard and
  its rows, read from the mesh coordinate (:func:`as_row_shard`);
* a plain tensor: the whole tensor, which only this sender publishes (e.g. a 0-d or 1-d tensor one rank
  owns).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Iterator

import torch

from ckpt.base import named_tensors
from ckpt.errors import CheckpointConfigError


@dataclasses.dataclass(frozen=True)
class RowShard:
    """Rows ``[row_start, row_start + local.shape[0])`` (dim 0) of a tensor of ``full_shape``.

    Attributes:
        local: the rows this rank holds, any dtype; shape ``(rows, *full_shape[1:])`` (``rows`` may be 0).
        row_start: the first row's index in the full tensor.
        full_shape: the full tensor's shape (at least 1-d).
    """

    local: torch.Tensor
    row_start: int
    full_shape: tuple[int, ...]

    def checked(self, name: str) -> RowShard:
        """This shard, after checking that it is a row range of ``full_shape``.

        Raises:
            CheckpointConfigError: not a tensor, a 0-d full shape, trailing dims that differ, or rows out of
                range (the message names ``name`` and the values).
        """
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
    """Rows ``[start, stop)`` of a tensor of ``rows`` rows that ``rank`` of ``world_size`` holds under FSDP2's
    dim-0 sharding (``torch.chunk``: ``ceil(rows / world_size)`` rows a chunk; trailing ranks may get fewer or
    none)."""
    chunk = -(-rows // world_size) if rows else 0
    start = min(rows, rank * chunk)
    return start, min(rows, start + chunk)


def as_row_shard(name: str, value: Any) -> RowShard | torch.Tensor:
    """``value`` as what a sender publishes: a :class:`RowShard` (checked), a ``DTensor`` made one, or a
    plain tensor (whole) as is.

    A ``DTensor`` must be placed ``Shard(0)`` on a 1-D mesh (FSDP2's layout), or ``Replicate()`` (then it is
    published whole by mesh coordinate 0 only: the other ranks get ``None``).

    Returns:
        A :class:`RowShard`, a ``torch.Tensor`` or ``None`` (a replicated tensor this rank leaves to another).

    Raises:
        CheckpointConfigError: another value or placement (named, with what is accepted).
    """
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
    """What trainer rank ``rank`` of a sharded trainer publishes from its ``state_dict().items()`` (FSDP2:
    ``DTensor`` parameters, plain-tensor buffers): each ``DTensor``'s own rows (:func:`as_row_shard`), and the
    plain tensors (every rank holds them whole) from rank 0 only, so each byte is sent once. Nothing is
    gathered; no rank touches another's shard.

    Args:
        named: ``(name, tensor)`` pairs, e.g. ``fsdp_module.state_dict().items()``.
        rank: this rank's index among the trainer's ranks (the mesh coordinate of FSDP2's 1-D mesh).
        dtype: cast floating-point values to it (e.g. ``torch.bfloat16``, what a rollout serves); ``None``:
            as they are. Only this rank's rows are cast (a private copy of its shard, not of the model).

    Raises:
        CheckpointConfigError: as :func:`as_row_shard`.
    """
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
