"""The weight checker: proves after an update that a rollout serves what the trainer published.

Both sides digest the same tensors, or regions of them, and compare; the rollout digests the parameters it
serves, never the buffers it received (vLLM's ``weight_checker``, verl's rollout weight-sync check). A key
names a tensor (``"name"``) or a region of one in the checkpoint tensor's coordinates (``"name[0:448, :]"``,
slices of the leading dimensions; a sharded trainer's rows ``"name[a:b]"``).

:func:`digest` runs with torch on the tensor's own device, with no host copy: the region as a matrix of rows
(its last dimension) of 64-bit words (a row zero padded to 8 bytes), and two sums modulo 2**64 (torch's integer
arithmetic wraps): of every word times ``2r+1``, and of the words of every :data:`SAMPLE`-th row times ``2c+1``,
``r`` and ``c`` the word's row and column in the whole tensor. A changed or lost word, moved rows and columns moved
in every row change it; it reads the data about once and copies nothing when rows are 8-byte aligned. Engines
carry the digests with the rollouts' reports (:mod:`ckpt.outcome`)."""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from ckpt.errors import WeightCheckError

_KEY = re.compile(r"^(?P<name>.+)\[(?P<region>[^\[\]]*)\]$")
_MASK = (1 << 64) - 1
SAMPLE = 16  # The column sums cover every SAMPLE-th row of the whole tensor (a second read of 1/SAMPLE of it).

Region = tuple[tuple[int, int], ...]  # (start, stop) per leading dimension
Locate = Callable[[str, Region], "torch.Tensor | None"]


def region_key(name: str, region: Region | Sequence[slice | tuple[int, int]] = ()) -> str:
    """Return the key of ``region`` of tensor ``name``: ``"name"`` for the whole, else ``"name[a:b, c:d]"``."""
    parts = [f"{s.start}:{s.stop}" if isinstance(s, slice) else f"{s[0]}:{s[1]}" for s in region]
    return f"{name}[{', '.join(parts)}]" if parts else name


def parse_key(key: str) -> tuple[str, Region | None]:
    """Return ``(name, region)`` of a key; ``region`` is ``None`` for a whole tensor, ``(start, stop)`` per dim else.

    A ``:`` slice is recorded as ``(0, -1)``: the whole dimension."""
    match = _KEY.match(key)
    if match is None:
        return key, None
    region = []
    for part in match["region"].split(","):
        start, sep, stop = part.strip().partition(":")
        if not sep or not (start.isdigit() or not start) or not (stop.isdigit() or not stop):
            return key, None  # a name that merely ends in brackets
        region.append((int(start or 0), int(stop) if stop else -1))
    return match["name"], tuple(region)


def _slices(tensor: torch.Tensor, region: Region) -> tuple[slice, ...]:
    return tuple(slice(a, tensor.shape[d] if b < 0 else b) for d, (a, b) in enumerate(region))


def _odd(start: int, n: int, device: torch.device) -> torch.Tensor:
    """``2 * [start, start + n) + 1`` as int64 on ``device``, kept for the shapes a model repeats."""
    key = (start, n, str(device))
    found = _ODD.get(key)
    if found is None:
        if len(_ODD) > 256:
            _ODD.clear()
        found = _ODD[key] = torch.arange(start, start + n, dtype=torch.int64, device=device) * 2 + 1
    return found


_ODD: dict[tuple[int, int, str], torch.Tensor] = {}


def _row_weights(shape: Sequence[int], origin: Sequence[int], full: Sequence[int], device: torch.device) -> torch.Tensor:
    """``2g+1`` of each row of a region, ``g`` its row (leading dims flattened) in the whole tensor, as int64."""
    if len(shape) == 2:
        return _odd(origin[0], shape[0], device)
    index = torch.zeros((), dtype=torch.int64, device=device)
    for d in range(len(shape) - 1):
        step = torch.arange(origin[d], origin[d] + shape[d], dtype=torch.int64, device=device)
        index = index.unsqueeze(-1) * full[d] + step
    return index.reshape(-1) * 2 + 1


def _words(region: torch.Tensor) -> torch.Tensor:
    """The region's rows as a ``(rows, words)`` int64 matrix, a view when rows are 8-byte aligned."""
    rows = region.reshape(-1, region.shape[-1]) if region.dim() >= 2 else region.reshape(1, -1)
    if rows.numel() == 0:
        return torch.zeros((rows.shape[0], 0), dtype=torch.int64, device=region.device)
    raw = rows.view(torch.uint8) if rows.stride(-1) == 1 else rows.contiguous().view(torch.uint8)
    width = raw.shape[-1]
    if width % 8 == 0 and raw.stride(0) % 8 == 0 and raw.storage_offset() % 8 == 0:
        return raw.view(torch.int64)
    padded = torch.zeros((raw.shape[0], -(-width // 8) * 8), dtype=torch.uint8, device=region.device)
    padded[:, :width] = raw
    return padded.view(torch.int64)


def _sums(tensor: torch.Tensor, origin: Sequence[int] = (), full: Sequence[int] | None = None) -> torch.Tensor:
    """The two digest sums of ``tensor``, a region at ``origin`` of a tensor of shape ``full``, as an int64 pair."""
    full = tuple(tensor.shape) if full is None else tuple(full)
    origin = tuple(origin) + (0,) * (tensor.dim() - len(origin))
    words = _words(tensor)
    device = words.device
    col0 = (origin[-1] * tensor.element_size()) // 8 if tensor.dim() else 0
    rows = _row_weights(tensor.shape, origin, full, device) if tensor.dim() >= 2 else _odd(0, 1, device)
    a = (words.sum(dim=1) * rows).sum()
    if tensor.dim() == 2:  # the sampled rows: every SAMPLE-th of the whole tensor
        sampled = words[(-origin[0]) % SAMPLE::SAMPLE]
    else:
        sampled = words[((rows - 1) // 2) % SAMPLE == 0] if tensor.dim() > 2 else words
    b = (sampled.sum(dim=0) * _odd(col0, words.shape[1], device)).sum()
    return torch.stack([a, b])


def _hex(pair: Sequence[int], shape: Sequence[int]) -> str:
    return f"{'x'.join(map(str, shape)) or 'scalar'}:{pair[0] & _MASK:016x}{pair[1] & _MASK:016x}"


def digest(tensor: torch.Tensor, origin: Sequence[int] = (), full_shape: Sequence[int] | None = None) -> str:
    """Return the digest of ``tensor``, or of it as the region at ``origin`` of a tensor of ``full_shape``."""
    return _hex(_sums(tensor.detach(), origin, full_shape).tolist(), tensor.shape)


class Digester:
    """Digests ``(key, tensor)`` pairs on their devices as they stream by; :meth:`result` reads them back once."""

    def __init__(self) -> None:
        self._pending: list[tuple[str, torch.Tensor, tuple[int, ...]]] = []
        self._done: dict[str, str] = {}

    def add(self, key: str, tensor: torch.Tensor, origin: Sequence[int] = (),
            full_shape: Sequence[int] | None = None) -> None:
        """Digest ``tensor`` (a region at ``origin`` of a tensor of ``full_shape``) under ``key``."""
        self._pending.append((key, _sums(tensor.detach(), origin, full_shape), tuple(tensor.shape)))

    def watch(self, weights: Iterable[tuple[str, Any]],
              parts: Mapping[str, tuple[Sequence[int], int]] | None = None) -> Iterator[tuple[str, Any]]:
        """Yield ``weights`` unchanged, digesting each tensor; a name in ``parts`` is a row part ``(full_shape, row_start)``."""
        for name, tensor in weights:
            part = parts.get(name) if parts is not None else None
            if not isinstance(tensor, torch.Tensor):
                if isinstance(getattr(tensor, "local", None), torch.Tensor):  # a RowShard; others fail downstream
                    self.add_shard(name, tensor)
            elif part is not None:
                full, start = part
                self.add(region_key(name, [(start, start + tensor.shape[0])]), tensor, (start,), full)
            else:
                self.add(name, tensor)
            yield name, tensor

    def add_shard(self, name: str, shard: Any) -> None:
        """Digest a :class:`ckpt.RowShard` under ``"name[a:b]"``."""
        local, start = shard.local, shard.row_start
        self.add(region_key(name, [(start, start + local.shape[0])]), local, (start,), shard.full_shape)

    def result(self) -> dict[str, str]:
        """Return ``{key: digest}`` of everything added so far, in order."""
        if self._pending:
            pairs = torch.stack([p.to("cpu") for _, p, _ in self._pending]).tolist()
            self._done.update({key: _hex(pair, shape) for (key, _, shape), pair in zip(self._pending, pairs)})
            self._pending = []
        return dict(self._done)


def digests(weights: Iterable[tuple[str, Any]]) -> dict[str, str]:
    """Return ``{key: digest}`` of ``(name, tensor)`` pairs (a :class:`ckpt.RowShard` under ``"name[a:b]"``)."""
    digester = Digester()
    for _ in digester.watch(weights):
        pass
    return digester.result()


def locate_region(live: Mapping[str, torch.Tensor], name: str, region: Region | None) -> torch.Tensor | None:
    """Return ``live[name]``'s view of ``region`` (the whole for ``None``), ``None`` if the rollout has no such tensor."""
    tensor = live.get(name)
    if tensor is None or region is None:
        return tensor
    if len(region) > tensor.dim() or any(b > tensor.shape[d] for d, (_, b) in enumerate(region)):
        return None
    return tensor[_slices(tensor, region)]


def served_digests(keys: Iterable[str], live: Mapping[str, torch.Tensor], locate: Locate | None = None) -> dict[str, str]:
    """Return ``{key: digest}`` of the rollout's ``live`` parameters for ``keys``; a key it cannot find is left out.

    ``locate(name, region)`` returns the live tensor holding a region (e.g. rows of a fused ``qkv_proj``), for a
    rollout that keeps checkpoint tensors elsewhere than under their names; the default looks up ``live[name]``."""
    digester = Digester()
    for key in keys:
        name, region = parse_key(key)
        if locate is not None:
            view = locate(name, region)
        else:
            view = locate_region(live, name, region)
            if view is None and region is not None and key in live:
                view, region = live[key], None
        if view is None:
            continue
        if region is None:
            digester.add(key, view)
        else:
            whole = live.get(name)
            full = tuple(whole.shape) if whole is not None and locate is None else None
            origin = [a for a, _ in region]
            if full is None:  # the shape of the checkpoint tensor is unknown here: the region is its own origin
                full = tuple(o + s for o, s in zip(origin, view.shape)) + tuple(view.shape[len(origin):])
            digester.add(key, view, origin, full)
    return digester.result()


def mismatches(expected: Mapping[str, str], served: Mapping[str, str], shown: int = 8) -> list[str]:
    """Return one sentence per key whose digest differs or is not served (at most ``shown``, then a count)."""
    out = []
    for key, value in expected.items():
        got = served.get(key)
        if got is None:
            out.append(f"{key!r} is not served")
        elif got != value:
            out.append(f"{key!r} differs (served {got}, published {value})")
    if len(out) > shown:
        out = out[:shown] + [f"and {len(out) - shown} more"]
    return out


def check(expected: Mapping[str, str], served: Mapping[str, str], where: str = "the rollout") -> None:
    """Raise :class:`WeightCheckError` naming every tensor ``served`` differs from ``expected`` in."""
    found = mismatches(expected, served)
    if found:
        raise WeightCheckError(f"{where} does not serve what the trainer published: {'; '.join(found)}",
                               {where: found})


__all__ = ["Digester", "WeightCheckError", "check", "digest", "digests", "locate_region", "mismatches",
           "parse_key", "region_key", "served_digests"]
