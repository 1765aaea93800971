"""Aligned byte layout: named tensors one after another, each at the next 64-byte aligned offset.

The one offset planner a rollout's weight bank and a transfer bucket share, so a sender and a receiver that
lay out the same tensors in the same order agree byte for byte. The receiver's layout is the one to agree
on: a sender rebuilds it with :meth:`WeightLayout.from_entries`."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from ckpt.base import NamedTensor
from ckpt.errors import CheckpointConfigError, WeightMismatchError

ALIGN = 64  # Byte alignment of tensors in a bank or a bucket (>= the element size of every dtype).


def align(n: int) -> int:
    """Round ``n`` bytes up to a multiple of :data:`ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


class AlignedCursor:
    """Places byte ranges from ``start``, each at the next aligned offset (or congruent to ``congruent_to``)."""

    def __init__(self, start: int = 0) -> None:
        self.end = start  # bytes used so far: the end of the last range placed

    def next_offset(self, congruent_to: int | None = None) -> int:
        return align(self.end) + (0 if congruent_to is None else congruent_to % ALIGN)

    def place(self, nbytes: int, congruent_to: int | None = None) -> int:
        """Place ``nbytes`` bytes; return their offset."""
        offset = self.next_offset(congruent_to)
        self.end = offset + nbytes
        return offset

    @property
    def total(self) -> int:
        return align(self.end)


def byte_view(buffer: torch.Tensor, offset: int, dtype: torch.dtype, shape: list[int] | tuple[int, ...]) -> torch.Tensor:
    """View ``buffer[offset:]`` (flat ``uint8``) as a tensor of ``dtype`` and ``shape``; no copy."""
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * dtype.itemsize
    return buffer[offset:offset + nbytes].view(dtype).view(tuple(shape))


@dataclasses.dataclass(frozen=True)
class LayoutEntry:
    """Where one tensor lives in a bank (``offset``, ``nbytes`` in bytes); picklable."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def named_weights(module: nn.Module) -> Iterator[NamedTensor]:
    """Yield what a module serves: parameters (a tied one once), then persistent buffers."""
    yield from module.named_parameters()
    persistent = set(module.state_dict(keep_vars=True))
    for name, buf in module.named_buffers():
        if name in persistent:
            yield name, buf


def local_weights(module: nn.Module) -> Iterator[NamedTensor]:
    """Yield :func:`named_weights`, a ``DTensor`` as the local shard it stores (so ``.data`` re-points it)."""
    from hal.torch_compat import dtensor_local

    for name, tensor in named_weights(module):
        yield name, dtensor_local(tensor) if _is_dtensor(tensor) else tensor


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(tensor, DTensor)


class WeightLayout:
    """The flat layout of named tensors (pairs, or a module), each at the next 64-byte aligned offset, in order.

    ``dtype``: floating-point tensors are laid out as this dtype (e.g. fp32 master weights published as bf16)."""

    def __init__(self, weights: Any, dtype: torch.dtype | None = None) -> None:
        pairs = local_weights(weights) if isinstance(weights, nn.Module) else weights
        self.entries: dict[str, LayoutEntry] = {}  # {name: LayoutEntry} in layout order
        cursor = AlignedCursor()  # the planner ckpt.bucket lays out a bucket's packed tensors with
        for name, tensor in pairs:
            if name in self.entries:
                raise CheckpointConfigError(f"tensor name {name!r} appears twice")
            dt = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            nbytes = tensor.numel() * dt.itemsize
            self.entries[name] = LayoutEntry(name, dt, tuple(tensor.shape), cursor.place(nbytes), nbytes)
        self.nbytes = cursor.total  # bytes of one bank

    @classmethod
    def from_entries(cls, entries: Iterable[LayoutEntry]) -> WeightLayout:
        """Rebuild the layout another side built from its entries, offsets kept.

        Raises :class:`CheckpointConfigError` for an entry that repeats, overlaps, is unaligned or out of order."""
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
        """The earlier name of :attr:`entries`."""
        return self.entries

    def allocate(self, device: torch.device | str) -> torch.Tensor:
        """Return a new zero-filled bank of :attr:`nbytes` on ``device``."""
        return torch.zeros(max(self.nbytes, ALIGN), dtype=torch.uint8, device=device)

    def view(self, bank: torch.Tensor, name: str) -> torch.Tensor:
        entry = self.entries[name]
        return byte_view(bank, entry.offset, entry.dtype, entry.shape)

    def views(self, bank: torch.Tensor) -> list[NamedTensor]:
        """Return ``(name, view into bank)`` for every tensor in layout order, as a list (runs may be sent in place)."""
        return [(name, self.view(bank, name)) for name in self.entries]

    def fill(self, bank: torch.Tensor, weights: Any) -> None:
        """Copy (and cast) ``weights`` into ``bank``; an unknown name or another shape is a :class:`WeightMismatchError`."""
        pairs = local_weights(weights) if isinstance(weights, nn.Module) else weights
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
        """Point every named tensor of ``module`` at its view in ``bank`` (the same ``Parameter`` objects).

        ``None`` points them at empty placeholders, freeing the module's hold on a bank."""
        for name, tensor in local_weights(module):
            if name not in self.entries:
                continue
            if bank is None:
                tensor.data = torch.empty(0, dtype=self.entries[name].dtype, device=tensor.device)
            else:
                tensor.data = self.view(bank, name)
