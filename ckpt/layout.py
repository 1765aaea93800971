"""Aligned byte layout: named tensors laid out one after another, each at the next 64-byte aligned offset.

The one planner of offsets that a rollout's weight bank (:class:`ckpt.serving.WeightLayout`) and a transfer
bucket (:mod:`ckpt.bucket`) share, so a sender and a receiver that lay out the same tensors in the same order
agree byte for byte on their relative offsets.
"""

from __future__ import annotations

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
