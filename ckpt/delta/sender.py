"""The trainer side of delta weight sync: a host snapshot of the last published values, diffed bit-wise.

Without a valid snapshot an update is a full seed (``dense`` flushes); else each tensor sends the int32
positions whose bits changed plus their values (``indices``), or goes ``dense`` where that is smaller or a
changed value is NaN (verl's SGLang loader marks "unchanged" with NaN).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

import hal
from ckpt.delta.checksum import combine
from ckpt.delta.diff import (MAX_GAP, Outputs, Segment, TensorDiff, bits, diff_segment, join, seed_segment,
                             segments)
from ckpt.delta.wire import POS_WIDTH, POSITIONS, SPEC, VALUES, encode_spec, flush_checksum
from ckpt.base import named_tensors
from ckpt.errors import CheckpointConfigError

Flush = tuple[list[tuple[str, torch.Tensor]], bool]
DEFAULT_FLUSH_BYTES = 64 << 20

@dataclass
class UpdateStats:
    """What one update sent: dense and sent bytes, changed/total values, tensor and flush counts, seed and reason."""

    step: int | None = None
    seed: bool = False
    reason: str | None = None
    total: int = 0
    changed: int = 0
    dense_bytes: int = 0
    sent_bytes: int = 0
    flushes: int = 0
    dense_tensors: int = 0
    sparse_tensors: int = 0

    @property
    def changed_fraction(self) -> float:
        """Return changed values / all values of the update (1.0 for a seed)."""
        return self.changed / self.total if self.total else 0.0

    @property
    def sent_ratio(self) -> float:
        """Return bytes sent / dense bytes."""
        return self.sent_bytes / self.dense_bytes if self.dense_bytes else 0.0


@dataclass
class _Bucket:
    encoding: str
    dtype: torch.dtype
    params: list[dict[str, Any]] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    checksums: dict[str, int] = field(default_factory=dict)
    pos_bytes: int = 0
    val_elems: int = 0
    nbytes: int = 0


class DeltaSender:
    """Diffs each update against the last published one and yields verl ``delta_flush`` flushes.

    ``snapshot`` holds the values last sent, in host buffers per segment (:mod:`ckpt.delta.diff`), pinned where
    the kind allows. An update is published only on :meth:`commit`; without one the next update is a full seed
    (as after :meth:`reseed` and on the first). Memory: :attr:`snapshot_bytes` of host memory, plus per segment
    one bool per word, plus two flushes of at most ``max(flush_bytes, largest tensor)``. An update never sends
    more than its dense bytes plus the JSON specs. ``flush_bytes``: close a flush at this many bytes;
    ``dtype``: cast floating tensors first (verl's ``rollout_dtype``).
    """

    def __init__(self, flush_bytes: int = DEFAULT_FLUSH_BYTES, dtype: torch.dtype | None = None,
                 device: str | None = None) -> None:
        if isinstance(flush_bytes, bool) or not isinstance(flush_bytes, int) or flush_bytes < 1:
            raise CheckpointConfigError(f"flush_bytes must be an int >= 1, got {flush_bytes!r}")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise CheckpointConfigError(f"dtype must be a torch.dtype or None, got {dtype!r}")
        self.flush_bytes, self.dtype = flush_bytes, dtype
        spec = hal.resolve_device(device)
        self.pin = bool(getattr(spec, "supports_pin_memory", False)) and not getattr(spec, "host_memory", False)
        self.snapshot: dict[str, torch.Tensor] = {}  # name -> a view of its segment's host words
        self._segments: dict[tuple, torch.Tensor] = {}  # segment key -> its host snapshot words (int64)
        self._parts: dict[str, tuple[int, int]] = {}  # each snapshot tensor's checksum parts
        self.published_step: int | None = None  # the step the snapshot holds, once committed
        self._valid = False  # the snapshot is a base the receivers hold (committed and not reseeded)
        self._reseed_reason: str | None = "first update"
        self.undelivered: UpdateStats | None = None  # the figures of the last update abandoned
        self._pending: UpdateStats | None = None
        self.last: UpdateStats | None = None
        self._outputs = Outputs()  # the C diff's pairs, kept from update to update

    @property
    def snapshot_bytes(self) -> int:
        """Return the bytes of host memory the snapshot holds."""
        return sum(s.numel() * s.element_size() for s in self._segments.values())

    @property
    def seeded(self) -> bool:
        """Return whether the next update will be a delta (a committed snapshot and no reseed asked)."""
        return self._valid and self._reseed_reason is None

    def reseed(self, reason: str = "asked") -> None:
        """Make the next update a full seed; ``reason`` is recorded in :attr:`last`."""
        self._reseed_reason = str(reason)

    def commit(self) -> UpdateStats:
        """Mark the update just produced as delivered: the snapshot becomes the base of the next delta."""
        if self._pending is None:
            raise CheckpointConfigError("DeltaSender.commit() without an update: iterate flushes(...) "
                                        "(or call delta_send) first")
        stats, self._pending = self._pending, None
        self._valid, self._reseed_reason = True, None
        self.published_step = stats.step
        self.last = stats
        return stats

    def abandon(self, reason: str) -> None:
        """Invalidate the snapshot: the update just produced was not delivered (the next update is a seed); its
        figures stay in :attr:`undelivered`."""
        self.undelivered, self._pending, self._valid = self._pending, None, False
        self._reseed_reason = f"last update not delivered: {reason}"

    # ---- producing flushes ---------------------------------------------------------------------------
    def flushes(self, weights: Iterable[tuple[str, torch.Tensor]], global_steps: int | None = None
                ) -> Iterator[Flush]:
        """Diff ``weights`` and yield ``(named_tensors, is_last)`` flushes in verl's ``delta_flush`` format.

        Flushes are on the weights' device; exactly one has ``is_last=True``. Dense values may be the weights
        themselves (send each flush before changing the weights); sparse ones may be views of buffers the next
        update reuses (send or copy an update's flushes before the next call).
        """
        seed = not self.seeded
        stats = UpdateStats(step=global_steps, seed=seed, reason=self._reseed_reason if seed else None)
        base = None if seed else self.published_step
        self._pending, self._valid = None, False  # not a valid base until committed
        if seed:
            self._segments, self.snapshot, self._parts = {}, {}, {}  # free the old base before the new one fills
        items = self._items(weights)
        buckets: dict[tuple[str, torch.dtype], _Bucket] = {}
        held: list[tuple[dict[str, Any], torch.Tensor | None, torch.Tensor]] = []  # the flush held back
        device = items[-1][1].device if items else torch.device("cpu")
        count = 0

        def close(bucket: _Bucket) -> Iterator[Flush]:
            nonlocal count
            parts = self._assemble(bucket, count, global_steps, base, device)
            count += 1
            stats.flushes += 1
            if held:
                yield self._named(*held.pop(), is_last=False, stats=stats)
            held.append(parts)

        old_segments, self._segments = self._segments, {}
        self._outputs.start()
        for seg in segments(items):
            for name, tensor, entry in self._diff(seg, old_segments.pop(seg.key, None), stats):
                if entry is None:
                    continue
                encoding, positions, values, checksum = entry
                key = (encoding, values.dtype)
                if encoding == "dense" and values.numel() * values.element_size() >= self.flush_bytes // 2:
                    alone = _Bucket(encoding, values.dtype)  # a flush of its own: its values are the tensor
                    self._add(alone, name, tensor, positions, values, checksum)
                    yield from close(alone)
                    continue
                bucket = buckets.setdefault(key, _Bucket(encoding, values.dtype))
                self._add(bucket, name, tensor, positions, values, checksum)
                if bucket.nbytes >= self.flush_bytes:
                    yield from close(buckets.pop(key))
        for key in list(buckets):
            yield from close(buckets.pop(key))
        if not held:  # nothing changed: one empty flush still carries the step (and is_last)
            yield from close(_Bucket("dense", self.dtype or torch.bfloat16))
        self._pending = stats
        yield self._named(*held.pop(), is_last=True, stats=stats)

    def _items(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        items = []
        for name, tensor in named_tensors(weights, unique=True):
            tensor = tensor.detach()
            if self.dtype is not None and tensor.is_floating_point() and tensor.dtype != self.dtype:
                tensor = tensor.to(self.dtype)
            bits(tensor.reshape(-1)[:0])  # a dtype that cannot be diffed bit-wise fails here, naming it
            items.append((name, tensor.contiguous()))
        return items

    def _diff(self, seg: Segment, snapshot: torch.Tensor | None, stats: UpdateStats):
        """Return ``(name, tensor, entry)`` per tensor of ``seg`` (entry ``None``: unchanged); update the snapshot."""
        for t in seg.tensors:
            stats.total += t.numel()
            stats.dense_bytes += t.numel() * t.element_size()
        if snapshot is None:
            snapshot = torch.empty(seg.words.numel(), dtype=torch.int64, device="cpu", pin_memory=self.pin)
            diffs = [TensorDiff(t.numel(), True, parts) for t, parts in zip(seg.tensors, seed_segment(seg, snapshot))]
        else:
            diffs = diff_segment(seg, snapshot, [self._parts[n] for n in seg.names], self.pin, self._outputs)
        self._segments[seg.key] = snapshot
        raw = snapshot.view(torch.uint8)
        for name, t, off, d in zip(seg.names, seg.tensors, seg.offsets, diffs):
            nb = t.numel() * t.element_size()
            self.snapshot[name] = raw[off:off + nb].view(t.dtype).view(t.shape)
            if d is None:
                yield name, t, None
                continue
            self._parts[name] = d.parts
            stats.changed += d.changed
            if d.dense:
                stats.dense_tensors += 1
                yield name, t, ("dense", None, t.reshape(-1), combine(d.parts))
            else:
                stats.sparse_tensors += 1
                yield name, t, ("indices", d.positions, d.values, combine(d.parts))

    @staticmethod
    def _add(bucket: _Bucket, name: str, tensor: torch.Tensor, positions, values, checksum: int) -> None:
        n = values.numel()
        pos_n = 0 if positions is None else positions.numel() * POS_WIDTH
        bucket.params.append({"name": name, "dtype": str(tensor.dtype).removeprefix("torch."),
                              "shape": list(tensor.shape)})  # offsets: once the flush's layout is known
        if positions is not None:
            bucket.positions.append(positions)
        bucket.values.append(values)
        bucket.checksums[name] = checksum
        bucket.pos_bytes += pos_n
        bucket.val_elems += n
        bucket.nbytes += pos_n + n * values.element_size()

    @staticmethod
    def _assemble(bucket: _Bucket, index: int, step: int | None, base: int | None,
                  device: torch.device) -> tuple[dict[str, Any], torch.Tensor | None, torch.Tensor]:
        device = bucket.values[0].device if bucket.values else device
        values, val_at = join(bucket.values, MAX_GAP) if bucket.values else (
            torch.empty(0, dtype=bucket.dtype, device=device), [])
        positions, pos_at = None, [0] * len(bucket.params)
        if bucket.encoding == "indices":
            joined, pos_at = join(bucket.positions)
            positions = joined.view(torch.uint8)
        for param, v, v0, p0 in zip(bucket.params, bucket.values, val_at, pos_at):
            pos_n = v.numel() * POS_WIDTH if positions is not None else 0
            param.update(pos_start=p0 * POS_WIDTH, pos_end=p0 * POS_WIDTH + pos_n, pos_width=POS_WIDTH,
                         val_start=v0, val_end=v0 + v.numel())
        spec = {"encoding": bucket.encoding, "params": bucket.params,
                "checksum": flush_checksum(positions, values),
                "hal": {"step": step, "base_step": base, "flush": index, "checksums": bucket.checksums}}
        if bucket.encoding == "dense":
            spec["verify"] = False
        return spec, positions, values

    @staticmethod
    def _named(spec: dict[str, Any], positions: torch.Tensor | None, values: torch.Tensor, is_last: bool,
               stats: UpdateStats) -> Flush:
        spec["hal"]["is_last"] = is_last
        named = [(SPEC, encode_spec(spec, values.device))]
        if positions is not None:
            named.append((POSITIONS, positions))
        named.append((VALUES, values))
        stats.sent_bytes += sum(t.numel() * t.element_size() for _, t in named)
        return named, is_last
