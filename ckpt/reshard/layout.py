"""Layouts: regions of checkpoint tensors that a trainer rank holds and that a rollout rank keeps."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping, Sequence

import torch

from ckpt.errors import CheckpointConfigError
from ckpt.wire import dtype_from_name, dtype_name


def _ints(values: Any, what: str) -> tuple[int, ...]:
    if not isinstance(values, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise CheckpointConfigError(f"{what} must be a sequence of ints, got {values!r}")
    return tuple(values)


@dataclasses.dataclass(frozen=True)
class Region:
    """A box of a tensor: ``sizes[d]`` elements from ``offsets[d]`` along each dimension ``d``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        offsets, sizes = _ints(self.offsets, "region offsets"), _ints(self.sizes, "region sizes")
        if len(offsets) != len(sizes) or min(offsets + sizes, default=0) < 0:
            raise CheckpointConfigError(f"a region needs as many offsets as sizes, none negative, got offsets "
                                        f"{offsets}, sizes {sizes}")
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "sizes", sizes)

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Region:
        return cls((0,) * len(shape), tuple(shape))

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def intersect(self, other: Region) -> Region | None:
        """The common box, or ``None`` where it is empty."""
        offsets, sizes = [], []
        for a, n, b, m in zip(self.offsets, self.sizes, other.offsets, other.sizes):
            lo, hi = max(a, b), min(a + n, b + m)
            if hi <= lo:
                return None
            offsets.append(lo)
            sizes.append(hi - lo)
        return Region(tuple(offsets), tuple(sizes))

    def within(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.sizes) and all(o + s <= n for o, s, n in zip(self.offsets, self.sizes, shape))

    def moved(self, origin: Sequence[int], to: Sequence[int]) -> Region:
        """This box in another frame: the point ``origin`` of this frame is ``to`` in the other."""
        return Region(tuple(o - a + b for o, a, b in zip(self.offsets, origin, to)), self.sizes)

    def rows(self, start: int, count: int) -> Region:
        """Rows ``[start, start + count)`` of this box (dim 0, relative to its first row)."""
        return Region((self.offsets[0] + start, *self.offsets[1:]), (count, *self.sizes[1:]))

    def index(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes)) + "]"


@dataclasses.dataclass(frozen=True)
class Slice:
    """``region`` of checkpoint tensor ``name`` (of ``full_shape``), kept by a rollout rank at ``at`` in its
    tensor ``target`` (of ``target_shape``, ``dtype``); a fused target (``qkv_proj``) has several slices."""

    name: str
    full_shape: tuple[int, ...]
    region: Region
    target: str
    target_shape: tuple[int, ...]
    at: tuple[int, ...]
    dtype: torch.dtype

    @property
    def dest(self) -> Region:
        """The region within ``target``."""
        return Region(self.at, self.region.sizes)

    def describe(self) -> str:
        return f"{self.name}{self.region} -> {self.target}{self.dest}"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "full_shape": list(self.full_shape), "offsets": list(self.region.offsets),
                "sizes": list(self.region.sizes), "target": self.target, "target_shape": list(self.target_shape),
                "at": list(self.at), "dtype": dtype_name(self.dtype)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Slice:
        try:
            return cls(d["name"], _ints(d["full_shape"], "full_shape"), Region(d["offsets"], d["sizes"]),
                       d["target"], _ints(d["target_shape"], "target_shape"), _ints(d["at"], "at"),
                       dtype_from_name(d["dtype"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointConfigError(f"not a rollout layout slice: {d!r} ({exc})") from exc


class RolloutLayout:
    """What one rollout rank keeps: its :class:`Slice` list, checked whole.

    Raises:
        CheckpointConfigError: a slice outside its tensor or its target, a target whose slices overlap or leave
            part of it unwritten, or a target given two shapes or dtypes (the message names the slice).
    """

    def __init__(self, slices: Iterable[Slice]) -> None:
        self.slices = tuple(slices)
        self.targets: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        by_target: dict[str, list[Slice]] = {}
        for s in self.slices:
            if not s.region.within(s.full_shape) or not s.dest.within(s.target_shape):
                raise CheckpointConfigError(f"rollout layout slice {s.describe()} lies outside {s.name} "
                                            f"{s.full_shape} or {s.target} {s.target_shape}")
            if self.targets.setdefault(s.target, (s.target_shape, s.dtype)) != (s.target_shape, s.dtype):
                raise CheckpointConfigError(f"rollout layout gives {s.target} two shapes or dtypes: "
                                            f"{self.targets[s.target]} and {(s.target_shape, s.dtype)}")
            by_target.setdefault(s.target, []).append(s)
        for target, parts in by_target.items():
            for i, a in enumerate(parts):
                for b in parts[i + 1:]:
                    if a.dest.intersect(b.dest) is not None:
                        raise CheckpointConfigError(f"rollout layout slices {a.describe()} and {b.describe()} "
                                                    "overlap in their target")
            if sum(p.region.numel for p in parts) != math.prod(self.targets[target][0]):
                raise CheckpointConfigError(f"rollout layout leaves part of {target} {self.targets[target][0]} "
                                            f"unwritten: its slices are {', '.join(p.describe() for p in parts)}")
        self.by_name: dict[str, list[Slice]] = {}
        for s in self.slices:
            self.by_name.setdefault(s.name, []).append(s)

    @property
    def nbytes(self) -> int:
        """Bytes this rank receives per update."""
        return sum(s.region.numel * s.dtype.itemsize for s in self.slices)

    def to_dict(self) -> dict[str, Any]:
        return {"slices": [s.to_dict() for s in self.slices]}

    @classmethod
    def from_dict(cls, d: Any) -> RolloutLayout:
        if isinstance(d, RolloutLayout):
            return d
        if not isinstance(d, Mapping) or not isinstance(d.get("slices"), list):
            raise CheckpointConfigError(f"a rollout layout must be a RolloutLayout or its to_dict(), got "
                                        f"{type(d).__name__}")
        return cls(Slice.from_dict(s) for s in d["slices"])

    @classmethod
    def whole(cls, tensors: Iterable[Holding]) -> RolloutLayout:
        """Every tensor whole, under its own name: a rollout that keeps the full model."""
        return cls(Slice(h.name, h.full_shape, Region.whole(h.full_shape), h.name, h.full_shape,
                         (0,) * len(h.full_shape), h.dtype) for h in tensors)


@dataclasses.dataclass(frozen=True)
class Holding:
    """``region`` of checkpoint tensor ``name`` (``full_shape``, ``dtype``) that a trainer rank sends."""

    name: str
    full_shape: tuple[int, ...]
    dtype: torch.dtype
    region: Region

    def to_list(self) -> list[Any]:
        return [self.name, list(self.full_shape), dtype_name(self.dtype), list(self.region.offsets),
                list(self.region.sizes)]

    @classmethod
    def from_list(cls, v: Sequence[Any]) -> Holding:
        name, full, dtype, offsets, sizes = v
        return cls(name, _ints(full, "full_shape"), dtype_from_name(dtype), Region(offsets, sizes))

    def describe(self) -> str:
        return f"{self.name} {dtype_name(self.dtype)} {self.full_shape} holding {self.region}"


def chunk_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``index`` of ``parts`` along a dimension of ``size`` (``torch.chunk``, as
    DTensor's ``Shard`` splits: ``ceil(size / parts)`` a chunk, trailing chunks shorter or empty)."""
    chunk = -(-size // parts) if size else 0
    start = min(size, index * chunk)
    return start, min(size, start + chunk)


def shard_region(shape: Sequence[int], placements: Sequence[Any], coordinate: Sequence[int],
                 mesh_shape: Sequence[int]) -> Region:
    """The region a DTensor's local tensor holds: ``Shard(d)`` chunks dimension ``d`` along each mesh dimension
    in order; ``Replicate`` keeps it whole.

    Raises:
        CheckpointConfigError: another placement (``Partial``, a strided shard).
    """
    from torch.distributed.tensor import Replicate, Shard

    offsets, sizes = [0] * len(shape), list(shape)
    for placement, index, parts in zip(placements, coordinate, mesh_shape):
        if type(placement) is Shard:
            start, stop = chunk_range(sizes[placement.dim], parts, index)
            offsets[placement.dim] += start
            sizes[placement.dim] = stop - start
        elif not isinstance(placement, Replicate):
            raise CheckpointConfigError(f"placement {placement} has no region (Shard(d) and Replicate() have)")
    return Region(tuple(offsets), tuple(sizes))


def local_region(name: str, value: Any) -> tuple[torch.Tensor, Region, tuple[int, ...]] | None:
    """``(local tensor, region, full shape)`` of what a rank publishes as ``value``: a ``ckpt.RowShard``, a
    ``DTensor`` (``None`` on a rank whose replica another rank sends) or a whole tensor.

    Raises:
        CheckpointConfigError: another value or placement.
    """
    from ckpt.shards import RowShard

    if isinstance(value, RowShard):
        part = value.checked(name)
        offsets = (part.row_start,) + (0,) * (len(part.full_shape) - 1)
        return part.local, Region(offsets, tuple(part.local.shape)), part.full_shape
    if not isinstance(value, torch.Tensor):
        raise CheckpointConfigError(f"weights must yield (str, torch.Tensor | ckpt.RowShard) pairs, got "
                                    f"({name!r}, {type(value).__name__})")
    try:
        from torch.distributed.tensor import DTensor, Replicate
    except ImportError:
        DTensor = None
    if DTensor is None or not isinstance(value, DTensor):
        return value, Region.whole(value.shape), tuple(value.shape)
    mesh, coordinate = value.device_mesh, value.device_mesh.get_coordinate()
    if coordinate is None:
        raise CheckpointConfigError(f"DTensor {name!r} is on a mesh this rank is not part of")
    if all(isinstance(p, Replicate) for p in value.placements) and any(coordinate):
        return None  # a replica: mesh coordinate 0 sends it
    full = tuple(value.shape)
    region = shard_region(full, value.placements, coordinate, mesh.shape)
    local = value.to_local()
    if tuple(local.shape) != region.sizes:
        raise CheckpointConfigError(f"DTensor {name!r}: rank holds {tuple(local.shape)}, its placements "
                                    f"{value.placements} give {region.sizes}")
    return local, region, full


def held_parts(weights: Iterable[tuple[str, Any]], dtype: torch.dtype | None = None
               ) -> list[tuple[torch.Tensor, Holding]]:
    """What a sender publishes, as ``(local tensor, Holding)`` in its order (references, no copy; floating
    tensors cast to ``dtype`` if given)."""
    from ckpt.base import named_tensors

    out = []
    for name, value in named_tensors(weights, accepted=()):
        held = local_region(name, value)
        if held is None:
            continue
        local, region, full = held
        if dtype is not None and local.is_floating_point() and local.dtype != dtype:
            local = local.to(dtype)
        out.append((local, Holding(name, full, local.dtype, region)))
    return out


__all__ = ["Holding", "Region", "RolloutLayout", "Slice", "chunk_range", "held_parts", "local_region",
           "shard_region"]
