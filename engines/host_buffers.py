"""Reusable (pinned where possible) host buffers for offloading device tensors.

Fresh host memory is slow: the first touch of each page faults (measured on a 2-core x86 host: ``clone()``
1.66 GB/s against ``copy_`` into an already touched buffer 14.3 GB/s), and pinning costs more. So an
engine keeps one host buffer per offloaded tensor, keyed by a stable name, and copies into it on every
later offload.

The buffers a first offload needs are carved out of a few pinned slabs (:meth:`HostBufferPool.reserve`)
instead of one pinned allocation per tensor: a few calls into the pinned allocator, each making a large
range resident at once (which the allocator can split over threads), instead of hundreds of small
allocations; PyTorch's ``CachingHostAllocator`` and DeepSpeed's pinned offload buffers group host memory
the same way.
"""

from __future__ import annotations

from typing import Hashable, Iterable

import torch

from hal import DeviceSpec

SLAB_ALIGNMENT = 64
"""Bytes each buffer's offset in a slab is rounded up to (a cache line; a multiple of every dtype's size)."""

SLAB_BYTES = 64 << 20
"""Bytes per slab, at most, an engine's offload asks :meth:`HostBufferPool.reserve` for: large enough that
each allocation is one bulk call (whose pages an allocator can make resident over several threads), and a
power of two, since caching host allocators round requests up to one (PyTorch's ``CachingHostAllocator``
does): a slab never asks for much more than it fills."""


def pin_memory_supported(spec: DeviceSpec) -> bool:
    """Whether an engine on ``spec``'s devices pins its host buffers: the kind's ``supports_pin_memory``
    fact, and never for host-memory kinds (nothing is copied there)."""
    return spec.supports_pin_memory and not spec.host_memory


class HostBufferPool:
    """Host tensors keyed by a stable name, allocated once and reused while shape and dtype match.

    Args:
        pin: allocate page-locked memory (only where :func:`pin_memory_supported` says so).

    Attributes:
        allocations: how many host buffers were allocated over the pool's life (a reused buffer does not
            count; each buffer carved out of a slab counts once), so a test can assert that a second
            offload allocated nothing.
    """

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.allocations = 0
        self._buffers: dict[Hashable, torch.Tensor] = {}

    def _fits(self, key: Hashable, like: torch.Tensor) -> bool:
        buf = self._buffers.get(key)
        return buf is not None and buf.shape == like.shape and buf.dtype == like.dtype

    def _carve(self, layout: list[tuple[Hashable, int, torch.Tensor]], total: int) -> None:
        slab = torch.empty(total, dtype=torch.uint8, device="cpu", pin_memory=self.pin)
        for key, offset, like in layout:
            self._buffers[key] = slab[offset:offset + like.numel() * like.element_size()].view(like.dtype).view(
                like.shape)
        self.allocations += len(layout)

    def reserve(self, items: Iterable[tuple[Hashable, torch.Tensor]], slab_bytes: int | None = None) -> int:
        """Allocate host slabs holding a buffer for every ``(key, like)`` that has no fitting buffer yet.

        Each buffer is a contiguous view of a slab with ``like``'s shape and dtype, at an offset rounded
        up to :data:`SLAB_ALIGNMENT` bytes, laid out in the order given (the order the caller copies in).
        Later :meth:`get` calls with the same key and a tensor of that shape and dtype return it. A slab is
        freed once every buffer carved from it is dropped (see :meth:`clear`). A key given twice gets one
        buffer.

        Args:
            items: ``(key, like)`` pairs; ``like`` is any tensor (its device is not used).
            slab_bytes: ``None``: one slab for everything. Otherwise the buffers are split, in order, into
                slabs of at most ``slab_bytes`` bytes (a buffer is never split: a larger one gets a slab of
                its own), so that an allocator that rounds requests up to a power of two (PyTorch's
                ``CachingHostAllocator``) wastes little.

        Returns:
            The bytes of all slabs (0 when every key already had a fitting buffer).

        Raises:
            ValueError: ``slab_bytes`` below 1.
            RuntimeError: the allocation failed (out of host memory).
        """
        if slab_bytes is not None and slab_bytes < 1:
            raise ValueError(f"slab_bytes must be None or >= 1, got {slab_bytes}")
        slabs: list[tuple[list[tuple[Hashable, int, torch.Tensor]], int]] = []
        seen: set[Hashable] = set()
        for key, like in items:
            if key in seen or self._fits(key, like):
                continue
            seen.add(key)
            nbytes = like.numel() * like.element_size()
            rounded = (nbytes + SLAB_ALIGNMENT - 1) // SLAB_ALIGNMENT * SLAB_ALIGNMENT
            if not slabs or (slab_bytes is not None and slabs[-1][1] and slabs[-1][1] + rounded > slab_bytes):
                slabs.append(([], 0))
            layout, total = slabs[-1]
            layout.append((key, total, like))
            slabs[-1] = (layout, total + rounded)
        if not slabs:
            return 0
        for layout, total in slabs:
            self._carve(layout, total)
        return sum(total for _, total in slabs)

    def get(self, key: Hashable, like: torch.Tensor) -> torch.Tensor:
        """A contiguous host tensor with ``like``'s shape and dtype, reused for the same ``key``.

        Its contents are whatever was copied in last; the caller overwrites them. A key without a fitting
        buffer (none reserved, or shape or dtype changed) gets one allocation of its own.
        """
        if not self._fits(key, like):
            self._buffers[key] = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self.pin)
            self.allocations += 1
        return self._buffers[key]

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the pool's buffers take."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def __len__(self) -> int:
        return len(self._buffers)

    def clear(self) -> None:
        """Drop every buffer (the memory is freed once no tensor refers to it any more)."""
        self._buffers.clear()

