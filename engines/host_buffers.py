"""Reusable (pinned where possible) host buffers for offloading device tensors.

Fresh host memory is slow: the first touch of each page faults (measured on a 2-core x86 host: ``clone()``
1.66 GB/s against ``copy_`` into an already touched buffer 14.3 GB/s), and pinning costs more. So an
engine keeps one host buffer per offloaded tensor, keyed by a stable name, and copies into it on every
later offload.

The buffers a first offload needs are carved out of one pinned slab (:meth:`HostBufferPool.reserve`)
instead of one pinned allocation per tensor: one call into the pinned allocator, which makes the whole
range resident at once (and can split that work over threads), instead of hundreds of small allocations;
PyTorch's ``CachingHostAllocator`` and DeepSpeed's pinned offload buffers group host memory the same way.
"""

from __future__ import annotations

from typing import Hashable, Iterable

import torch

from devices.base import DeviceSpec

_PIN_SUPPORT: dict[str, bool] = {}

SLAB_ALIGNMENT = 64
"""Bytes each buffer's offset in a slab is rounded up to (a cache line; a multiple of every dtype's size)."""


def pin_memory_supported(spec: DeviceSpec) -> bool:
    """Whether host memory can be page-locked for copies to and from ``spec``'s devices.

    ``False`` for host-memory kinds (nothing is copied). Otherwise the spec's own ``supports_pin_memory``
    attribute if it has one, else a probe: allocate one pinned element through the current accelerator's
    pinned allocator (how ``torch.empty(pin_memory=True)`` works in torch 2.13) and check ``is_pinned()``.
    A ``RuntimeError`` (no pinned allocator registered, as on a CPU-only build) means unsupported. The
    result is cached per kind; :func:`reset_pin_memory_cache` clears it.
    """
    if spec.host_memory:
        return False
    declared = getattr(spec, "supports_pin_memory", None)
    if declared is not None:
        return bool(declared() if callable(declared) else declared)
    if spec.kind not in _PIN_SUPPORT:
        try:
            _PIN_SUPPORT[spec.kind] = bool(torch.empty(1, pin_memory=True).is_pinned())
        except RuntimeError:
            _PIN_SUPPORT[spec.kind] = False
    return _PIN_SUPPORT[spec.kind]


def reset_pin_memory_cache() -> None:
    """Forget cached pinning probes (tests, or after a device kind was registered)."""
    _PIN_SUPPORT.clear()


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

    def reserve(self, items: Iterable[tuple[Hashable, torch.Tensor]]) -> int:
        """Allocate, in one host slab, a buffer for every ``(key, like)`` that has no fitting buffer yet.

        Each buffer is a contiguous view of the slab with ``like``'s shape and dtype, at an offset rounded
        up to :data:`SLAB_ALIGNMENT` bytes, laid out in the order given (the order the caller copies in).
        Later :meth:`get` calls with the same key and a tensor of that shape and dtype return it. The slab
        is freed once every buffer carved from it is dropped (see :meth:`clear`). A key given twice gets
        one buffer.

        Args:
            items: ``(key, like)`` pairs; ``like`` is any tensor (its device is not used).

        Returns:
            The slab's size in bytes (0 when every key already had a fitting buffer).
        """
        wanted: dict[Hashable, tuple[int, torch.Tensor]] = {}
        total = 0
        for key, like in items:
            if key in wanted or self._fits(key, like):
                continue
            wanted[key] = (total, like)
            nbytes = like.numel() * like.element_size()
            total += (nbytes + SLAB_ALIGNMENT - 1) // SLAB_ALIGNMENT * SLAB_ALIGNMENT
        if not wanted:
            return 0
        slab = torch.empty(total, dtype=torch.uint8, device="cpu", pin_memory=self.pin)
        for key, (offset, like) in wanted.items():
            nbytes = like.numel() * like.element_size()
            self._buffers[key] = slab[offset:offset + nbytes].view(like.dtype).view(like.shape)
            self.allocations += 1
        return total

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
        """Bytes of host memory the pool holds."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def __len__(self) -> int:
        return len(self._buffers)

    def clear(self) -> None:
        """Drop every buffer (the memory is freed once no tensor refers to it any more)."""
        self._buffers.clear()
