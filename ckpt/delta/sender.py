"""The trainer side of delta weight sync: a host snapshot of the last published values, diffed bit-wise.

:class:`DeltaSender` turns each update's ``(name, tensor)`` pairs into verl's ``delta_flush`` flushes
(:mod:`ckpt.delta.wire`): a full seed (``dense`` flushes of every tensor) when it holds no valid snapshot,
then, per tensor, the int32 positions whose bits changed plus their new values (``indices`` flushes), or the
whole tensor (``dense``) where that is smaller or where a changed value is NaN (verl's SGLang loader marks
"unchanged" with NaN, so a NaN cannot travel sparse).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

import hal
from ckpt.delta.checksum import combine, raw_words, updated_parts, word_parts
from ckpt.delta.wire import POS_WIDTH, POSITIONS, SPEC, VALUES, encode_spec, flush_checksum
from ckpt.errors import CheckpointConfigError

Flush = tuple[list[tuple[str, torch.Tensor]], bool]
DEFAULT_FLUSH_BYTES = 64 << 20

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (contiguous) flattened and viewed as the signed integer type of its element size, so
    ``==`` compares raw bits (NaN equals itself, ``-0.0`` differs from ``0.0``).

    Raises:
        CheckpointConfigError: an element size with no integer type (complex128 and the like).
    """
    flat = tensor.reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    try:
        return flat.view(_INT_VIEW[flat.element_size()])
    except KeyError:
        raise CheckpointConfigError(f"cannot diff dtype {flat.dtype} bit-wise (element size "
                                    f"{flat.element_size()}; accepted sizes: {sorted(_INT_VIEW)})") from None


@dataclass
class UpdateStats:
    """What one update sent: ``dense_bytes`` (the published tensors' bytes), ``sent_bytes`` (positions +
    values + specs), ``changed``/``total`` values, ``dense_tensors``/``sparse_tensors``, ``flushes``, and
    ``seed`` (a full seed) with its ``reason``."""

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
        """Changed values / all values of the update (1.0 for a seed)."""
        return self.changed / self.total if self.total else 0.0

    @property
    def sent_ratio(self) -> float:
        """Bytes sent / dense bytes."""
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

    State: ``snapshot``, one host tensor per published name (same dtype and shape; pinned where the
    device kind supports pinned host memory and is not host memory itself), holding the values the
    receivers were last sent. Each tensor of an update is diffed on its own device against its snapshot
    (copied over, compared as raw integer bits via :func:`bits`); the snapshot is then brought up to date
    with the changed values. The update counts as published only when :meth:`commit` is called after the
    transport returned: if the caller does not commit (the send raised, a receiver refused), the snapshot
    is no longer a valid base and the next update is a full seed, which is what any receiver in an unknown
    state needs. (Keeping the previous values until the commit instead would double the memory bound.)

    A full seed is sent: on the first update, after :meth:`reseed` (the caller's word that a receiver
    joined late, failed its last update or restarted, or that the topology changed), and after an update
    that was not committed. A tensor whose name, shape or dtype is new goes dense.

    Memory: :attr:`snapshot_bytes` of host memory, plus on the device per tensor one copy of its snapshot
    and a bool mask while it is diffed, plus the flushes: the one being filled and the one held back to
    learn which flush is last, each at most ``max(flush_bytes, the largest tensor's bytes)`` (a tensor's
    entry is never split), plus what the engine holds. Positions cost 4 bytes per changed value; a tensor
    goes dense when ``changed * (4 + element size) >= numel * element size``, so an update never sends
    more than its dense bytes plus the JSON specs (a few hundred bytes per tensor).

    Args:
        flush_bytes: close a flush once its positions + values reach this many bytes (int >= 1).
        dtype: cast floating-point tensors to this dtype before diffing (verl's ``rollout_dtype``);
            ``None`` (default): send them as given.
        device: device kind of the published tensors, to decide pinning (``None``: hal's resolution).

    Raises:
        CheckpointConfigError: a bad ``flush_bytes`` / ``dtype``.
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
        self.snapshot: dict[str, torch.Tensor] = {}
        self._parts: dict[str, tuple[int, int]] = {}  # each snapshot tensor's checksum parts
        self.published_step: int | None = None  # the step the snapshot holds, once committed
        self._valid = False  # the snapshot is a base the receivers hold (committed and not reseeded)
        self._reseed_reason: str | None = "first update"
        self._pending: UpdateStats | None = None
        self.last: UpdateStats | None = None

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of host memory the snapshot holds (the published tensors' bytes once seeded)."""
        return sum(t.numel() * t.element_size() for t in self.snapshot.values())

    @property
    def seeded(self) -> bool:
        """Whether the next update will be a delta (a committed snapshot and no reseed asked)."""
        return self._valid and self._reseed_reason is None

    def reseed(self, reason: str = "asked") -> None:
        """Make the next update a full seed (a receiver joined late, failed its last update or restarted,
        or the topology changed). ``reason`` is recorded in :attr:`last`."""
        self._reseed_reason = str(reason)

    def commit(self) -> UpdateStats:
        """Mark the update just produced as delivered: the snapshot becomes the base of the next delta.

        Raises:
            CheckpointConfigError: no update was produced since the last commit.
        """
        if self._pending is None:
            raise CheckpointConfigError("DeltaSender.commit() without an update: iterate flushes(...) "
                                        "(or call delta_send) first")
        stats, self._pending = self._pending, None
        self._valid, self._reseed_reason = True, None
        self.published_step = stats.step
        self.last = stats
        return stats

    def abandon(self, reason: str) -> None:
        """The update just produced was not delivered: invalidate the snapshot (the next update is a seed)."""
        self._pending, self._valid = None, False
        self._reseed_reason = f"last update not delivered: {reason}"

    # ---- producing flushes ---------------------------------------------------------------------------
    def flushes(self, weights: Iterable[tuple[str, torch.Tensor]], global_steps: int | None = None
                ) -> Iterator[Flush]:
        """Diff ``weights`` and yield ``(named_tensors, is_last)`` flushes in verl's ``delta_flush`` format.

        Args:
            weights: ``(name, tensor)`` pairs of the update (any device; floating tensors in the published
                dtype, or cast to ``dtype``). Names must be unique.
            global_steps: the step this update publishes (carried in each spec's ``hal.step``).

        Yields:
            ``([("__delta_spec__", uint8), ("__positions__", uint8)?, ("__values__", dtype)], is_last)``,
            on the weights' device; exactly one item has ``is_last=True`` (an update with nothing changed
            is one empty ``dense`` flush). The tensors are the sender's own (not views of ``weights``).

        Raises:
            CheckpointConfigError: a name appears twice, or a pair is not ``(str, Tensor)``.
        """
        seed = not self.seeded
        stats = UpdateStats(step=global_steps, seed=seed, reason=self._reseed_reason if seed else None)
        base = None if seed else self.published_step
        self._pending, self._valid = None, False  # not a valid base until committed
        if seed:
            self.snapshot, self._parts = {}, {}  # the old one is no base any more; free it before the new one fills
        buckets: dict[tuple[str, torch.dtype], _Bucket] = {}
        held: list[tuple[dict[str, Any], torch.Tensor | None, torch.Tensor]] = []  # the flush held back
        seen: set[str] = set()
        device = torch.device("cpu")  # of the last tensor seen (an empty update's flush lives on the host)
        count = 0

        def close(bucket: _Bucket) -> Iterator[Flush]:
            nonlocal count
            parts = self._assemble(bucket, count, global_steps, base, device)
            count += 1
            stats.flushes += 1
            if held:
                yield self._named(*held.pop(), is_last=False, stats=stats)
            held.append(parts)

        for name, tensor in weights:
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                raise CheckpointConfigError(f"weights must yield (str, torch.Tensor) pairs, got "
                                            f"({name!r}, {type(tensor).__name__})")
            if name in seen:
                raise CheckpointConfigError(f"tensor name {name!r} appears twice in one update")
            seen.add(name)
            tensor = tensor.detach()
            if self.dtype is not None and tensor.is_floating_point() and tensor.dtype != self.dtype:
                tensor = tensor.to(self.dtype)
            device = tensor.device
            entry = self._diff(name, tensor.contiguous(), stats)
            if entry is None:
                continue
            encoding, positions, values, checksum = entry
            bucket = buckets.setdefault((encoding, values.dtype), _Bucket(encoding, values.dtype))
            self._add(bucket, name, tensor, positions, values, checksum)
            if bucket.nbytes >= self.flush_bytes:
                yield from close(buckets.pop((encoding, values.dtype)))
        for key in list(buckets):
            yield from close(buckets.pop(key))
        if not held:  # nothing changed: one empty flush still carries the step (and is_last)
            yield from close(_Bucket("dense", self.dtype or torch.bfloat16))
        self._pending = stats
        yield self._named(*held.pop(), is_last=True, stats=stats)

    def _diff(self, name: str, tensor: torch.Tensor, stats: UpdateStats):
        """``(encoding, positions int32 | None, values, checksum)`` for one tensor, or ``None`` if unchanged;
        updates the snapshot, its checksum parts and ``stats``.

        The comparison runs on 64-bit words (a quarter of the bf16 elements to scan for changes), then on
        the elements of the changed words only; the new checksum is the old one updated by those words.
        """
        flat = tensor.reshape(-1)
        es = flat.element_size()
        nbytes = flat.numel() * es
        stats.total += flat.numel()
        stats.dense_bytes += nbytes
        old = self.snapshot.get(name)
        if old is None or old.shape != tensor.shape or old.dtype != tensor.dtype:
            self.snapshot[name] = host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                                                     pin_memory=self.pin)
            host.copy_(tensor)
            return self._dense(name, flat, stats)
        old_flat = old.reshape(-1)
        old_dev = old_flat.to(flat.device, non_blocking=self.pin)
        per = 8 // es
        head = flat.numel() - flat.numel() % per  # elements in whole 64-bit words
        if flat.storage_offset() % per or old_dev.storage_offset() % per:
            head = 0  # not word-aligned in its storage: compare element by element
        word_changed = None
        if head == flat.numel():  # all in words: count changed words first (changed values lie in [k, per k])
            word_changed = (flat.view(torch.uint8).view(torch.int64) != old_dev.view(torch.uint8).view(torch.int64))
            k = int(torch.count_nonzero(word_changed))
            if k == 0:
                return None
            surely_sparse = k * per * (POS_WIDTH + es) < nbytes
        else:
            surely_sparse = False
        changed = None if surely_sparse else int(torch.count_nonzero(bits(flat) != bits(old_dev)))
        if changed == 0:
            return None
        if changed is not None and changed * (POS_WIDTH + es) >= nbytes:  # dense: no positions to find
            old_flat.copy_(flat)
            return self._dense(name, flat, stats, changed=changed)
        pos_parts, val_parts = [], []
        parts = self._parts[name]
        if head:
            new_w = flat[:head].view(torch.uint8).view(torch.int64)
            old_w = old_dev[:head].view(torch.uint8).view(torch.int64)
            words = (word_changed if word_changed is not None else new_w != old_w).nonzero().reshape(-1)
            del word_changed
            new_ws, old_ws = new_w.index_select(0, words), old_w.index_select(0, words)
            new_elems = new_ws.view(flat.dtype)
            j = (bits(new_elems) != bits(old_ws.view(flat.dtype))).nonzero().reshape(-1)  # in the changed words
            shift = per.bit_length() - 1  # per is 1, 2, 4 or 8
            pos_parts.append((words.index_select(0, j >> shift) << shift) | (j & (per - 1)))
            val_parts.append(new_elems.index_select(0, j))
            parts = updated_parts(parts, words, old_ws, new_ws)
            old_flat[:head].view(torch.uint8).view(torch.int64).index_copy_(0, words.to("cpu"), new_ws.to("cpu"))
        if head < flat.numel():
            rest = (bits(flat[head:]) != bits(old_dev[head:])).nonzero().reshape(-1) + head
            pos_parts.append(rest)
            val_parts.append(flat.index_select(0, rest))
            if head:  # the last, zero-padded word of the checksum
                last = torch.tensor([head // per], dtype=torch.int64, device=flat.device)
                parts = updated_parts(parts, last, raw_words(old_dev[head:]), raw_words(flat[head:]))
            else:
                parts = word_parts(raw_words(flat))
            old_flat[head:].copy_(flat[head:])
        positions = torch.cat(pos_parts) if len(pos_parts) > 1 else pos_parts[0]
        values = torch.cat(val_parts) if len(val_parts) > 1 else val_parts[0]
        self._parts[name] = parts
        changed = positions.numel()
        if self._goes_dense(values, changed, nbytes, es):
            return self._dense(name, flat, stats, changed=changed, parts=parts)
        return self._sparse(positions, values, parts, stats)

    @staticmethod
    def _goes_dense(values: torch.Tensor, changed: int, nbytes: int, es: int) -> bool:
        """A delta at least as large as the tensor, or a NaN among the changed values (verl's SGLang loader
        reads NaN in a sparse flush as "unchanged")."""
        if changed * (POS_WIDTH + es) >= nbytes:
            return True
        return values.is_floating_point() and bool(torch.isnan(values).any())

    def _dense(self, name: str, flat: torch.Tensor, stats: UpdateStats, changed: int | None = None,
               parts: tuple[int, int] | None = None):
        self._parts[name] = parts if parts is not None else word_parts(raw_words(flat))
        stats.changed += flat.numel() if changed is None else changed
        stats.dense_tensors += 1
        return "dense", None, flat, combine(self._parts[name])

    @staticmethod
    def _sparse(positions: torch.Tensor, values: torch.Tensor, parts: tuple[int, int], stats: UpdateStats):
        stats.changed += positions.numel()
        stats.sparse_tensors += 1
        return "indices", positions.to(torch.int32), values, combine(parts)

    @staticmethod
    def _add(bucket: _Bucket, name: str, tensor: torch.Tensor, positions, values, checksum: int) -> None:
        n = values.numel()
        pos_n = 0 if positions is None else positions.numel() * POS_WIDTH
        bucket.params.append({"name": name, "dtype": str(tensor.dtype).removeprefix("torch."),
                              "shape": list(tensor.shape), "pos_start": bucket.pos_bytes,
                              "pos_end": bucket.pos_bytes + pos_n, "pos_width": POS_WIDTH,
                              "val_start": bucket.val_elems, "val_end": bucket.val_elems + n})
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
        values = (torch.cat(bucket.values) if len(bucket.values) > 1 else bucket.values[0].clone()) \
            if bucket.values else torch.empty(0, dtype=bucket.dtype, device=device)
        positions = None
        if bucket.encoding == "indices":
            positions = torch.cat(bucket.positions).view(torch.uint8)
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
