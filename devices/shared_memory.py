"""POSIX shared-memory segments mapped as flat ``uint8`` host tensors: how host memory is shared on one host.

The cpu kind (and Ascend stacks without IPC) share a bucket this way, and the simulated npu backs its
shareable device buffers with it (:mod:`devices.npu_sim.ipc`). A segment is named as
``multiprocessing.shared_memory`` names it (``/dev/shm/<name>`` on Linux), so verl's receiver attaches to it
with ``SharedMemory(name=...)``.

Why not ``SharedMemory.buf`` for the tensor: a tensor from ``torch.frombuffer(shm.buf)`` exports the mapping, and
``shm.close()`` then raises ``BufferError: cannot close exported pointers exist`` whenever a consumer still
holds a view (twinkle issue 102). Here the segment is created and registered by the standard library, which
then lets go of its own mapping, and torch maps the file itself (``torch.from_file(..., shared=True)``): the
mapping lives exactly as long as the tensors that view it, and closing never raises.

Leaks: the creator's segment is registered with ``multiprocessing``'s resource tracker (a separate process), so
a creator killed with SIGKILL still has its segment unlinked when the tracker sees it gone; :meth:`unlink`
removes it at once and unregisters it. An attaching process registers nothing (Python before 3.13 registers
attached segments too and unlinks them when *that* process exits, under the creator's feet).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
from multiprocessing import shared_memory

import torch

SHM_DIR = "/dev/shm"
"""Where Linux keeps POSIX shared-memory segments (``shm_open`` names are files here)."""


def segment_path(name: str) -> str:
    """The file of segment ``name`` (``/dev/shm/<name>``)."""
    return os.path.join(SHM_DIR, name.lstrip("/"))


class SharedSegment:
    """A new shared-memory segment of ``nbytes`` bytes, mapped here as :attr:`tensor` and touched once.

    Args:
        nbytes: size in bytes (> 0).
        prefix: the start of its name (the rest is random), e.g. ``"hal-ipc-"``.

    Attributes:
        name: the segment's name, as ``SharedMemory(name=...)`` and :func:`attach` take it.
        tensor: flat ``uint8`` tensor of ``nbytes`` over the segment (every page touched, so the first update
            pays no page faults on this side).

    Raises:
        ValueError: ``nbytes`` is not a positive int (names it).
        OSError: the segment cannot be created or its pages cannot be reserved (``/dev/shm`` missing, or too full
            for ``nbytes``: ``ENOSPC``, naming the segment and its size; nothing is left behind).
    """

    def __init__(self, nbytes: int, prefix: str = "hal-") -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"a shared segment needs a positive int of bytes, got {nbytes!r}")
        shm = shared_memory.SharedMemory(name=f"{prefix}{secrets.token_hex(6)}", create=True, size=nbytes)
        self._shm = shm
        self.name, self.nbytes = shm.name, nbytes
        shm.close()  # the standard library's mapping; torch maps the file itself below
        try:
            reserve(segment_path(self.name), nbytes)
            self.tensor = torch.from_file(segment_path(self.name), shared=True, size=nbytes, dtype=torch.uint8)
            self.tensor.zero_()  # first touch now: a fresh page costs a fault (BASELINES: clone 1.66 GB/s vs copy 14)
        except BaseException:
            self.unlink()
            raise

    def unlink(self) -> None:
        """Remove the segment's name (idempotent). Mappings already open, here or in other processes, stay valid
        until their tensors are freed; nothing is left in ``/dev/shm``."""
        shm, self._shm = self._shm, None
        if shm is not None:
            try:
                shm.unlink()
            except FileNotFoundError:
                pass


def reserve(path: str, nbytes: int) -> None:
    """Allocate the first ``nbytes`` bytes of the tmpfs file ``path`` now (``posix_fallocate``), so a filesystem
    too full for them fails here with ``OSError(ENOSPC)`` instead of killing the process with ``SIGBUS`` at the
    first touch of a page that tmpfs cannot provide (a mapping's writes have no error return)."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot reserve {nbytes} bytes for shared segment {path}: {exc.strerror} "
                                 f"(its filesystem is too full)") from None
    finally:
        os.close(fd)


def attach(name: str, nbytes: int) -> torch.Tensor:
    """Map segment ``name`` (at least ``nbytes`` bytes) as a flat ``uint8`` tensor of ``nbytes``; registers nothing.

    Raises:
        FileNotFoundError: no such segment (its creator unlinked it, or died and the tracker did).
        ValueError: the segment is smaller than ``nbytes`` (names both sizes).
    """
    path = segment_path(name)
    size = os.stat(path).st_size
    if size < nbytes:
        raise ValueError(f"shared segment {name!r} has {size} bytes, fewer than the {nbytes} announced")
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def unlink(name: str) -> bool:
    """Remove segment ``name`` if it is still there (a peer that owned it died); returns whether it was.
    Mappings already open stay valid until their tensors are freed."""
    try:
        os.unlink(segment_path(name))
        return True
    except FileNotFoundError:
        return False


MADV_DONTNEED = 4
"""Linux ``madvise`` advice: drop the range's page-table entries (``man 2 madvise``). On a shared file mapping
(a segment) no data is lost: the pages stay in the segment and a later read maps them again."""


def drop_mapped_pages(mapping: torch.Tensor, start: int, nbytes: int) -> bool:
    """Unmap this process's pages of ``mapping[start:start + nbytes]`` (``madvise(MADV_DONTNEED)``), so a
    reader's resident memory stops counting a segment it has read: a rollout reading a trainer's update of
    1 GB in place would otherwise hold the whole of it resident until the mapping goes.

    The range is widened to whole pages but never beyond the mapping, which is page-aligned (``mmap``).

    Args:
        mapping: the whole mapped segment, as :func:`attach` or :class:`SharedSegment` give it (flat ``uint8``,
            starting at the mapping's first byte); any other tensor would lose data, so only those are taken.
        start, nbytes: the range, in bytes from the mapping's start.

    Returns:
        Whether pages were dropped (``False`` where ``madvise`` is unavailable or refuses: nothing changes).

    Raises:
        ValueError: the range is not within ``mapping``, or ``mapping`` does not start on a page (not a mapping).
    """
    size, base, page = mapping.numel(), mapping.data_ptr(), mmap.PAGESIZE
    if base % page or start < 0 or nbytes < 0 or start + nbytes > size:
        raise ValueError(f"cannot drop bytes [{start}, {start + nbytes}) of a mapping of {size} bytes at "
                         f"{base:#x}: the range must lie within a page-aligned mapped segment")
    first = (start // page) * page
    last = min(-(-(start + nbytes) // page) * page, -(-size // page) * page)
    if last <= first:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(base + first), ctypes.c_size_t(last - first), MADV_DONTNEED) == 0
    except (OSError, AttributeError):
        return False


def segments(prefix: str) -> list[str]:
    """Names of the segments in ``/dev/shm`` starting with ``prefix`` (what a leak check counts)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


__all__ = ["MADV_DONTNEED", "SHM_DIR", "SharedSegment", "attach", "drop_mapped_pages", "reserve", "segment_path", "segments",
           "unlink"]
