"""What a rollout proves after an update: the step it serves, a CRC-32 per tensor (or region, keyed as
:mod:`ckpt.checker` keys them) equal to the trainer's, and a greedy decode equal to the trainer's."""

from __future__ import annotations

import re
import time
from typing import Any, Callable, Iterable

import torch

from ckpt.checker import locate_region, parse_key, region_key
from ckpt.vllm_transfer import crc32_hex as crc32
from hal.apps.weightsync.messages import Checked, Reference


def checksums(weights: Iterable[tuple[str, Any]]) -> dict[str, str]:
    """``{key: CRC-32 of the bytes}`` in iteration order, keyed as :mod:`ckpt.checker` keys regions (a
    ``ckpt.RowShard`` under ``"name[start:stop]"``)."""
    out = {}
    for name, value in weights:
        if isinstance(value, torch.Tensor):
            out[name] = crc32(value)
        else:  # a RowShard: rows [row_start, row_start + rows) of the full tensor
            out[region_key(name, [(value.row_start, value.row_start + value.local.shape[0])])] = crc32(value.local)
    return out


def served_checksums(expected: dict[str, str], served: dict[str, torch.Tensor]) -> dict[str, str]:
    """The checksums of what a rollout serves, keyed as ``expected``, plus every served tensor no key covers."""
    out, covered = {}, set()
    for key in expected:
        name, region = (key, None) if key in served else parse_key(key)
        covered.add(name)
        view = locate_region(served, name, region)
        if view is not None:
            out[key] = crc32(view)
    out.update({name: crc32(t) for name, t in served.items() if name not in covered})
    return out


REGION_KEY = re.compile(r"^(?P<name>.+)\[(?P<dims>(\d+:\d+(, )?)*)\]$")  # "name[a:b, c:d]": a box of a tensor


def slice_checksums(weights: Iterable[tuple[str, Any]], layouts: list) -> dict[str, str]:
    """``{"name[a:b, c:d]": CRC-32}`` of every piece this trainer rank sends the rollout ranks of ``layouts``
    (each a ``ckpt.reshard.RolloutLayout`` dict, ``None`` for the whole model), keyed by its region."""
    from ckpt.reshard import RolloutLayout, held_parts, pair_plan

    parts = held_parts(weights)
    held = [h for _, h in parts]
    out = {}
    for r, given in enumerate(layouts):
        layout = RolloutLayout.whole(held) if given is None else RolloutLayout.from_dict(given)
        for p in pair_plan(held, layout, 0, r):
            out[f"{p.name}{p.region}"] = crc32(parts[p.index][0][p.source.index()])
    return out


def verify_slices(adapter: Any, step: int, expected: dict[str, str], layout: Any) -> str | None:
    """What is wrong with a tensor-parallel rank after ``step``: the step it serves, else the first slice of
    ``layout`` whose served bytes differ from the trainer's checksums or that no checksum covers."""
    from ckpt.reshard import Region

    if adapter.served_step != step:
        return f"rollout serves step {adapter.served_step}, expected {step}"
    served, covered = adapter.state_dict(), {}
    for key, digest in expected.items():
        match = REGION_KEY.match(key)
        if match is None:
            continue
        bounds = [tuple(map(int, d.split(":"))) for d in match["dims"].split(", ") if d]
        region = Region(tuple(a for a, _ in bounds), tuple(b - a for a, b in bounds))
        for s in layout.by_name.get(match["name"], ()):
            if s.region.intersect(region) == region or not region.sizes:
                dest = region.moved(s.region.offsets, s.at)
                got = crc32(served[s.target][dest.index()])
                if got != digest:
                    return f"slice {key} in {s.target}{dest}: checksum {got} differs from the trainer's {digest}"
                covered[s] = covered.get(s, 0) + region.numel
    for s in layout.slices:
        if covered.get(s, 0) != s.region.numel:
            return f"slice {s.describe()}: the trainer's checksums cover {covered.get(s, 0)} of {s.region.numel} elements"
    return None


def first_mismatch(expected: dict[str, str], got: dict[str, str]) -> str | None:
    """A sentence naming the first tensor that differs, is missing or is unexpected; ``None`` if equal."""
    for name, digest in expected.items():
        if name not in got:
            return f"tensor {name!r} was not received"
        if got[name] != digest:
            return f"tensor {name!r}: checksum {got[name]} differs from the trainer's {digest}"
    extra = sorted(set(got) - set(expected))
    return f"tensor {extra[0]!r} was received but not sent" if extra else None


def verify(adapter: Any, step: int, expected: dict[str, str], served: dict[str, torch.Tensor] | None = None
           ) -> str | None:
    """What is wrong with a rollout after receiving ``step``: the step it serves, else the first differing
    checksum of ``served`` (default ``adapter.state_dict()``); ``None`` when it serves ``step`` byte-exact."""
    if adapter.served_step != step:
        return f"rollout serves step {adapter.served_step}, expected {step}"
    return first_mismatch(expected, served_checksums(expected, adapter.state_dict() if served is None else served))


def compare_decode(tokens: list[int], logits: torch.Tensor, reference: Reference, atol: float) -> tuple[bool, float, str | None]:
    """A rollout's greedy decode against the trainer's: ``(tokens equal, largest |logits difference|, error)``."""
    diff = float((logits - reference.logits).abs().max())
    equal = tokens == reference.tokens
    if not equal:
        return equal, diff, f"greedy decode gave tokens {tokens}, the trainer's model {reference.tokens}"
    if not diff <= atol:
        return equal, diff, f"decode logits differ from the trainer's by {diff:.3g} (> --logits-atol {atol:g})"
    return equal, diff, None


def verify_rollout(adapter: Any, step: int, reference: Reference,
                   decode: Callable[[], tuple[list[int], torch.Tensor]] | None, atol: float,
                   layout: Any = None, served: dict[str, torch.Tensor] | None = None) -> Checked:
    """What a rollout proves after receiving ``step``: :func:`verify` of ``served`` (:func:`verify_slices` for a
    tensor-parallel rank's ``layout``), then :func:`compare_decode` of ``decode()`` (``None``: no decode; on a
    tensor-parallel rank a collective, run by every rank of the server, which all serve the same step)."""
    start = time.perf_counter()
    out = Checked(error=verify(adapter, step, reference.sums, served) if layout is None else
                  verify_slices(adapter, step, reference.sums, layout))
    if adapter.served_step == step and reference.tokens is not None and decode is not None:
        tokens, logits = decode()
        out.tokens = tokens
        out.tokens_equal, out.logits_max_diff, error = compare_decode(tokens, logits, reference, atol)
        out.error = out.error or error
    out.verify_s = time.perf_counter() - start
    return out


__all__ = ["REGION_KEY", "slice_checksums", "verify_slices", "checksums", "crc32", "served_checksums", "compare_decode",
           "first_mismatch", "verify", "verify_rollout"]
