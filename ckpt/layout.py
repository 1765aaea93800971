"""Aligned byte layout: named tensors laid out one after another, each at the next 64-byte aligned offset.

The one planner of offsets that a rollout's weight bank and a transfer bucket (:mod:`ckpt.bucket`) share, so a
sender and a receiver that lay out the same tensors in the same order agree byte for byte on their relative
offsets. :class:`WeightLayout` is a module's weights so laid out (:func:`named_weights`: parameters, then
persistent buffers): the bank a rollout serves from (:mod:`ckpt.serving`), and the layout a trainer publishes
in when it wants its tensors to land in place.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from ckpt.base import NamedTensor
from ckpt.errors import CheckpointConfigError, WeightMismatchError

ALIGN = 64
"""Byte alignment of tensors in a bank or a bucket (>= the element size of every dtype)."""


def align(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN` (bytes)."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


class AlignedCursor:
    """Places byte ranges one after another from ``start``, each at the next :data:`ALIGN`-aligned offset.

    ``place(nbytes, congruent_to=address)`` places a range at the next offset congruent to ``address``
    modulo :data:`ALIGN` instead (a run of tensors copied from a storage keeps its in-storage alignment).
    """

    def __init__(self, start: int = 0) -> None:
        self.end = start
        """Bytes used so far: the end of the last range placed."""

    def next_offset(self, congruent_to: int | None = None) -> int:
        """Where :meth:`place` would put the next range (bytes), without placing it."""
        return align(self.end) + (0 if congruent_to is None else congruent_to % ALIGN)

    def place(self, nbytes: int, congruent_to: int | None = None) -> int:
        """Place ``nbytes`` bytes; returns their offset."""
        offset = self.next_offset(congruent_to)
        self.end = offset + nbytes
        return offset

    @property
    def total(self) -> int:
        """Bytes of the whole layout, rounded up to :data:`ALIGN`."""
        return align(self.end)


def byte_view(buffer: torch.Tensor, offset: int, dtype: torch.dtype, shape: list[int] | tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``dtype``/``shape`` viewing ``buffer[offset:]`` (a flat ``uint8`` tensor); no copy."""
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * dtype.itemsize
    return buffer[offset:offset + nbytes].view(dtype).view(tuple(shape))


@dataclasses.dataclass(frozen=True)
class LayoutEntry:
    """Where one tensor lives in a bank: ``offset`` and ``nbytes`` in bytes, its dtype and shape.

    Picklable (a typed message a rollout can hand to its trainer)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def named_weights(module: nn.Module) -> Iterator[NamedTensor]:
    """``(name, tensor)`` of what a module serves and a trainer publishes: parameters (a tied weight once,
    under its first name, as ``named_parameters`` gives it), then persistent buffers."""
    yield from module.named_parameters()
    persistent = set(module.state_dict(keep_vars=True))
    for name, buf in module.named_buffers():
        if name in persistent:
            yield name, buf


class WeightLayout:
    """The flat layout of named tensors: each at the next 64-byte aligned offset, in the given order.

    Args:
        weights: ``(name, tensor)`` pairs (only names, dtypes and shapes are read), or a module (its
            :func:`named_weights`).
        dtype: if given, floating-point tensors are laid out as this dtype (e.g. a trainer's fp32 master
            weights laid out as the bf16 it publishes).

    Raises:
        CheckpointConfigError: two tensors share a name.

    A sender and a receiver that lay out the same names in the same order agree byte for byte on relative
    offsets, so a run of tensors sent straight from one bank lands straight in the other. The receiver's
    layout is the one to agree on: a sender rebuilds it with :meth:`from_entries` from the receiver's
    :attr:`entries` rather than laying out its own model.
    """

    def __init__(self, weights: Any, dtype: torch.dtype | None = None) -> None:
        pairs = named_weights(weights) if isinstance(weights, nn.Module) else weights
        self.entries: dict[str, LayoutEntry] = {}
        """``{name: LayoutEntry}`` in layout order."""
        cursor = AlignedCursor()  # the planner ckpt.bucket lays out a bucket's packed tensors with
        for name, tensor in pairs:
            if name in self.entries:
                raise CheckpointConfigError(f"tensor name {name!r} appears twice")
            dt = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            nbytes = tensor.numel() * dt.itemsize
            self.entries[name] = LayoutEntry(name, dt, tuple(tensor.shape), cursor.place(nbytes), nbytes)
        self.nbytes = cursor.total
        """Bytes of one bank."""

    @classmethod
    def from_entries(cls, entries: Iterable[LayoutEntry]) -> WeightLayout:
        """The layout another side built, from its entries (e.g. a rollout's ``layout.entries.values()``
        handed to its trainer), offsets kept as given.

        Raises:
            CheckpointConfigError: a name twice, an entry that is not a :class:`LayoutEntry`, an offset not
                64-byte aligned, ``nbytes`` that disagrees with dtype and shape, or entries that overlap or
                are not in ascending offset order (names the entry).
        """
        layout = cls([])
        end = 0
        for entry in entries:
            if not isinstance(entry, LayoutEntry):
                raise CheckpointConfigError(f"layout entries must be LayoutEntry, got {type(entry).__name__}")
            numel = 1
            for d in entry.shape:
                numel *= d
            if entry.name in layout.entries:
                raise CheckpointConfigError(f"tensor name {entry.name!r} appears twice")
            if entry.offset % ALIGN or entry.offset < end or entry.nbytes != numel * entry.dtype.itemsize:
                raise CheckpointConfigError(
                    f"layout entry {entry.name!r} (offset {entry.offset}, {entry.nbytes} bytes, {entry.dtype} "
                    f"{entry.shape}) must start at a multiple of {ALIGN} bytes at or after byte {end} and hold "
                    f"{numel * entry.dtype.itemsize} bytes")
            layout.entries[entry.name] = entry
            end = entry.offset + entry.nbytes
        layout.nbytes = align(end)
        return layout

    @property
    def slots(self) -> dict[str, LayoutEntry]:
        """Kept for callers of the earlier name: :attr:`entries`."""
        return self.entries

    def allocate(self, device: torch.device | str) -> torch.Tensor:
        """A new bank on ``device``: flat ``uint8`` of :attr:`nbytes`, zero-filled so its pages are resident."""
        return torch.zeros(max(self.nbytes, ALIGN), dtype=torch.uint8, device=device)

    def view(self, bank: torch.Tensor, name: str) -> torch.Tensor:
        """Tensor ``name`` inside ``bank`` (no copy)."""
        entry = self.entries[name]
        return byte_view(bank, entry.offset, entry.dtype, entry.shape)

    def views(self, bank: torch.Tensor) -> list[NamedTensor]:
        """``(name, view into bank)`` for every tensor, in layout order: contiguous, back to back.

        A list (every view exists at once), so an engine may send runs of them straight from the bank
        (:func:`ckpt.bucket.plan_messages` copies the tensors of any other iterable as they are yielded)."""
        return [(name, self.view(bank, name)) for name in self.entries]

    def fill(self, bank: torch.Tensor, weights: Any) -> None:
        """Copy (and cast) ``weights`` (pairs or a module) into ``bank``.

        Raises:
            WeightMismatchError: a name that is not in the layout, or a shape that differs from its entry's
                (``copy_`` would broadcast it silently).
        """
        pairs = named_weights(weights) if isinstance(weights, nn.Module) else weights
        with torch.no_grad():
            for name, tensor in pairs:
                entry = self.entries.get(name)
                if entry is None:
                    raise WeightMismatchError(f"tensor {name!r} is not among the {len(self.entries)} tensors "
                                              "of the layout")
                if tuple(tensor.shape) != entry.shape:
                    raise WeightMismatchError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the layout "
                                              f"holds {entry.shape}")
                self.view(bank, name).copy_(tensor.detach())

    def bind(self, module: nn.Module, bank: torch.Tensor | None) -> None:
        """Point every named tensor of ``module`` at its view in ``bank`` (``.data`` assignment: the same
        ``Parameter`` objects, tied ones included); ``None`` points them at empty placeholders (frees the
        module's hold on a bank)."""
        for name, tensor in named_weights(module):
            if name not in self.entries:
                continue
            if bank is None:
                tensor.data = torch.empty(0, dtype=self.entries[name].dtype, device=tensor.device)
            else:
                tensor.data = self.view(bank, name)
