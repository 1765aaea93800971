"""The plan between a trainer rank and a rollout rank: the pieces that travel, and how they fill buckets."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Mapping, Sequence

import torch

from ckpt.errors import CheckpointConfigError
from ckpt.layout import AlignedCursor
from ckpt.reshard.layout import Holding, Region, RolloutLayout


class PlanError(CheckpointConfigError):
    """A plan cannot be formed from the two layouts (names the parameter and both sides)."""


@dataclasses.dataclass(frozen=True)
class Piece:
    """``region`` of tensor ``name``: at ``source`` in the sender's tensor number ``index``, at ``dest`` in the
    rollout's tensor ``target``."""

    name: str
    index: int
    region: Region
    source: Region
    target: str
    dest: Region
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.region.numel * self.dtype.itemsize

    def rows(self, start: int, count: int) -> Piece:
        """Rows ``[start, start + count)`` of this piece (dim 0)."""
        return dataclasses.replace(self, region=self.region.rows(start, count),
                                   source=self.source.rows(start, count), dest=self.dest.rows(start, count))


def pair_plan(held: Sequence[Holding], layout: RolloutLayout, sender: int, receiver: int) -> list[Piece]:
    """The pieces sender ``sender`` sends rollout rank ``receiver``: in the sender's order, then the layout's.

    Raises:
        PlanError: a tensor both sides name with another full shape or dtype.
    """
    pieces = []
    for index, h in enumerate(held):
        for s in layout.by_name.get(h.name, ()):
            if s.full_shape != h.full_shape or s.dtype != h.dtype:
                raise PlanError(f"parameter {h.name!r} cannot be resharded: trainer rank {sender} publishes "
                                f"{h.describe()}, rollout rank {receiver} keeps {s.describe()} of a "
                                f"{str(s.dtype).removeprefix('torch.')} {s.full_shape} tensor")
            common = h.region.intersect(s.region)
            if common is not None:
                pieces.append(Piece(h.name, index, common, common.moved(h.region.offsets, (0,) * len(common.sizes)),
                                    s.target, common.moved(s.region.offsets, s.at), h.dtype))
    return pieces


def check_coverage(layout: RolloutLayout, plans: Mapping[int, Sequence[Piece]],
                   held: Mapping[int, Sequence[Holding]], receiver: int) -> None:
    """Check that the senders' pieces fill every slice of ``layout`` exactly once.

    Raises:
        PlanError: a slice no trainer rank publishes, or one the trainer ranks' regions cover twice or
            leave a gap in (names the parameter, the slice and what each trainer rank holds of it).
    """
    by_target: dict[str, list[Piece]] = {}
    for pieces in plans.values():
        for p in pieces:
            by_target.setdefault(p.target, []).append(p)
    for s in layout.slices:
        got = sum(p.region.numel for p in by_target.get(s.target, ())
                  if p.name == s.name and s.dest.intersect(p.dest) == p.dest)
        if got == s.region.numel:
            continue
        holders = "; ".join(f"trainer rank {r}: {h.region}" for r, hs in held.items() for h in hs if h.name == s.name)
        why = ("no trainer rank publishes it" if not holders else
               "the trainer ranks' regions overlap" if got > s.region.numel else "the trainer ranks leave a gap")
        raise PlanError(f"parameter {s.name!r} cannot be resharded to rollout rank {receiver}: it keeps "
                        f"{s.describe()}, {why} ({got} of {s.region.numel} elements; {holders or 'held nowhere'})")


def layout_digest(layout: RolloutLayout) -> str:
    """A short digest of a layout, so that the two sides of a pair can tell they planned from the same one."""
    return hashlib.sha1(json.dumps(layout.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Packed:
    """A piece at ``offset`` bytes in its bucket."""

    piece: Piece
    offset: int


def bucket_plan(pieces: Sequence[Piece], bucket_size: int) -> list[list[Packed]]:
    """Pieces in order, each at the next 64-byte aligned offset of a bucket of ``bucket_size`` bytes; a piece
    that does not fit is split along dim 0 (both sides of a pair compute the same buckets).

    Raises:
        CheckpointConfigError: one row of a piece is larger than a bucket.
    """
    out: list[list[Packed]] = []
    bucket: list[Packed] = []
    cursor = AlignedCursor()
    for p in pieces:
        rows = p.region.sizes[0] if p.region.sizes else 1
        row_bytes = p.nbytes // rows
        if row_bytes > bucket_size:
            raise CheckpointConfigError(f"bucket_size {bucket_size} is smaller than one row ({row_bytes} bytes) "
                                        f"of {p.name}{p.region}")
        start = 0
        while start < rows:
            fit = max(0, bucket_size - cursor.next_offset()) // row_bytes
            if fit == 0:
                out.append(bucket)
                bucket, cursor = [], AlignedCursor()
                continue
            count = min(fit, rows - start)
            part = p if count == rows else p.rows(start, count)
            bucket.append(Packed(part, cursor.place(part.nbytes)))
            start += count
    if bucket:
        out.append(bucket)
    return out


def bucket_bytes(bucket: Sequence[Packed]) -> int:
    """Bytes a bucket's pieces span."""
    last = bucket[-1]
    return last.offset + last.piece.nbytes


__all__ = ["Packed", "Piece", "PlanError", "bucket_bytes", "bucket_plan", "check_coverage", "layout_digest",
           "pair_plan"]
