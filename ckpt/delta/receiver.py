"""The rollout side of delta weight sync: apply verl ``delta_flush`` flushes onto a model's own parameters.

:class:`DeltaReceiver` writes in place into the served tensors, checking verl's per-flush checksum and hal's
per-tensor checksum of each result (:mod:`ckpt.delta.wire`):

* ``atomic=True``: results are checked and the writes staged; the served tensors change only after the last
  flush, when every checksum matched, so a refused update leaves the previous step served. Memory: the
  staged update (the whole model for a seed).
* ``atomic=False``: each tensor is written as its flush arrives, then checked; a refusal leaves the rollout
  ``degraded``. Memory: one flush.

Each tensor's checksum is kept running and updated from the bits a delta writes, so the model is not re-read
(``full_verify=True`` re-reads written tensors). A refusal raises :class:`DeltaRefusedError` naming the tensor;
then only a full seed is taken.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ckpt.delta import kernel
from ckpt.delta.checksum import add_parts, combine, element_delta, parts_and_copy, tensor_parts
from ckpt.delta.diff import bits
from ckpt.delta.errors import DeltaBaseError, DeltaChecksumError, DeltaRefusedError
from ckpt.delta.wire import POS_WIDTH, POSITIONS, SPEC, VALUES, decode_spec, flush_checksum


class DeltaReceiver:
    """Applies ``delta_flush`` updates in place onto ``target_params`` (name -> served, contiguous tensor).

    ``served_step``: the step the tensors already hold, if known to equal the sender's snapshot (``None``: only a
    seed is taken). Attributes: ``served_step``, ``needs_seed``, ``degraded`` (an in-place update refused part-way),
    ``last_changed`` (values written by the last update).
    """

    def __init__(self, target_params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                 atomic: bool = True, served_step: int | None = None, full_verify: bool = False) -> None:
        self.targets = dict(target_params)
        self.atomic = bool(atomic)
        self.served_step = served_step
        self.needs_seed = served_step is None
        self.degraded = False
        self.last_changed = 0
        self._step: int | None = None  # the update in progress (None: between updates)
        self._in_update = False
        self._staged: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
        self._changed = 0
        self.full_verify = bool(full_verify)
        self._parts: dict[str, tuple[int, int]] = {}  # each served tensor's running checksum parts
        self._pending_parts: dict[str, tuple[int, int]] = {}  # the update's, until it completes

    # ---- one flush -----------------------------------------------------------------------------------
    def apply_flush(self, named_tensors: Iterable[tuple[str, torch.Tensor]], is_last: bool | None = None
                    ) -> int | None:
        """Apply one flush; return the step now served when it completed the update, else ``None``.

        ``is_last`` ``None``: as the spec says. DeltaChecksumError on a checksum mismatch, DeltaBaseError for a delta
        onto another step, DeltaRefusedError for an unknown tensor or another dtype/shape.
        """
        try:
            return self._apply(dict(named_tensors), is_last)
        except DeltaRefusedError:
            self._refuse()
            raise

    def abort(self, reason: str) -> None:
        """Drop what was staged for an update the transport failed; in place, become ``degraded``; a seed is next."""
        if self._in_update or self._staged:
            self._refuse()
        self.abort_reason = reason

    def _refuse(self) -> None:
        if not self.atomic and self._changed:
            self.degraded = True
        self._staged, self._changed, self._in_update, self._step = [], 0, False, None
        self._pending_parts, self._parts = {}, {}  # recomputed from the tensors when next needed
        self.needs_seed = True

    def _apply(self, tensors: dict[str, torch.Tensor], is_last: bool | None) -> int | None:
        if SPEC not in tensors or VALUES not in tensors:
            raise DeltaChecksumError(f"a delta flush needs {SPEC} and {VALUES}; got {sorted(tensors)}")
        try:
            spec = decode_spec(tensors[SPEC])
        except ValueError as exc:
            raise DeltaChecksumError(f"refused a delta flush: {exc}") from exc
        values, positions = tensors[VALUES], tensors.get(POSITIONS)
        hal_meta = spec.get("hal")
        if not isinstance(hal_meta, dict) or not isinstance(hal_meta.get("checksums"), dict):
            raise DeltaRefusedError("this delta flush carries no per-tensor checksums (spec key 'hal'): it was "
                                    "not made by ckpt.delta.DeltaSender; apply it with verl's delta_loader")
        step, base = hal_meta.get("step"), hal_meta.get("base_step")
        # verl's flush checksum guards positions before any is written; dense values: per-tensor checksums
        got = flush_checksum(positions, values) if spec.get("encoding") != "dense" else spec.get("checksum")
        if got != spec.get("checksum"):
            raise DeltaChecksumError(f"refused step {step}: flush {hal_meta.get('flush')} (tensors "
                                     f"{[p.get('name') for p in spec.get('params', [])][:8]}) has checksum {got}, "
                                     f"the sender's is {spec.get('checksum')}: corrupted in transit", step=step)
        if not self._in_update:
            self._in_update, self._step, self._changed = True, step, 0
            if base is not None and (self.needs_seed or base != self.served_step):
                why = ("it needs a full seed (its last update was refused or it just started)" if self.needs_seed
                       else f"it serves step {self.served_step}")
                raise DeltaBaseError(f"refused step {step}: a delta onto step {base}, but {why}; the sender "
                                     "must reseed()", step=step)
        elif step != self._step:
            raise DeltaChecksumError(f"flush of step {step} inside the update to step {self._step}", step=step)
        encoding = spec.get("encoding")
        if encoding not in ("dense", "indices"):
            raise DeltaChecksumError(f"refused step {step}: unknown encoding {encoding!r}", step=step)
        if encoding == "indices" and positions is None:
            raise DeltaChecksumError(f"refused step {step}: an 'indices' flush without {POSITIONS}", step=step)
        checks: list = []
        for param in spec.get("params", []):
            self._apply_param(param, encoding, positions, values, hal_meta["checksums"], step, checks)
        self._verify(checks, step)
        last = bool(hal_meta.get("is_last")) if is_last is None else bool(is_last)
        if not last:
            return None
        for target, index, vals in self._staged:
            _write(target, index, vals)
        self._parts.update(self._pending_parts)
        self._pending_parts = {}
        self.last_changed = self._changed
        self._staged, self._changed, self._in_update = [], 0, False
        self.served_step, self.needs_seed, self.degraded = step, False, False
        return step

    def _apply_param(self, param: dict[str, Any], encoding: str, positions: torch.Tensor | None,
                     values: torch.Tensor, checksums: dict[str, int], step: int | None, checks: list) -> None:
        name = param.get("name")
        target = self.targets.get(name)
        if target is None:
            raise DeltaRefusedError(f"refused step {step}: tensor {name!r} is not one of this rollout's "
                                    f"{len(self.targets)} tensors", tensor=name, step=step)
        target = target.detach()
        dtype, shape = str(target.dtype).removeprefix("torch."), list(target.shape)
        if param.get("dtype") != dtype or param.get("shape") != shape or not target.is_contiguous():
            raise DeltaRefusedError(f"refused step {step}: tensor {name!r} arrives as {param.get('dtype')} "
                                    f"{param.get('shape')}, the rollout holds {dtype} {shape}"
                                    f"{'' if target.is_contiguous() else ' (not contiguous)'}", tensor=name, step=step)
        v0, v1 = param.get("val_start", -1), param.get("val_end", -1)
        numel = target.numel()
        bad_layout = not 0 <= v0 <= v1 <= values.numel() or values.dtype != target.dtype
        if encoding == "dense":
            bad_layout = bad_layout or v1 - v0 != numel
        else:
            p0, p1 = param.get("pos_start", -1), param.get("pos_end", -1)
            bad_layout = (bad_layout or param.get("pos_width") != POS_WIDTH or not 0 <= p0 <= p1 <= positions.numel()
                          or p1 - p0 != POS_WIDTH * (v1 - v0) or p0 % POS_WIDTH)
        if bad_layout:
            raise DeltaChecksumError(f"refused step {step}: tensor {name!r} has an inconsistent {encoding} layout "
                                     f"in its flush ({param})", tensor=name, step=step)
        vals = values[v0:v1]
        expected = checksums.get(name)
        if encoding == "dense":
            if self.atomic:
                parts = tensor_parts(vals)
                self._staged.append((target, None, vals))
            else:
                parts = _copy_with_parts(target, vals)
            checks.append((name, expected, parts, None))
            self._changed += numel
            return
        index32 = positions[p0:p1].view(torch.int32)
        old_parts = self._parts.get(name)
        if old_parts is None:  # first delta onto tensors it was built with: their checksum, once
            old_parts = self._parts[name] = tensor_parts(target)
        lib = _host_kernel(target, index32, vals)
        if lib is not None and not self.full_verify:  # one loop: read the old bits, sum the change, write
            change = kernel.apply(lib, bits(target), index32, bits(vals), write=not self.atomic)
            if isinstance(change, int):
                raise DeltaChecksumError(f"refused step {step}: tensor {name!r} has positions outside its {numel} "
                                         f"values (position {int(index32[change])})", tensor=name, step=step)
            if self.atomic:
                self._staged.append((target, index32, vals))
            self._changed += vals.numel()
            checks.append((name, expected, old_parts, change))
            return
        index = index32.to(device=target.device, dtype=torch.int64)
        dst = bits(target)
        try:
            old = dst.index_select(0, index)
        except (IndexError, RuntimeError) as exc:
            raise DeltaChecksumError(f"refused step {step}: tensor {name!r} has positions outside its {numel} "
                                     f"values ({exc})", tensor=name, step=step) from None
        new = bits(vals.to(target.device))
        here = vals.device  # the checksum change is computed where the values arrived
        dw, ds = element_delta(index.to(here), old.to(here), bits(vals), target.element_size())
        if self.atomic:
            self._staged.append((target, index, vals))
        else:
            dst.index_copy_(0, index, new)
        self._changed += vals.numel()
        if self.full_verify:  # read the whole result: catches bytes changed behind the receiver's back too
            if self.atomic:
                scratch = target.clone()
                bits(scratch).index_copy_(0, index, new)
                checks.append((name, expected, tensor_parts(scratch), None))
            else:
                checks.append((name, expected, tensor_parts(target), None))
            return
        checks.append((name, expected, old_parts, torch.stack([dw, ds])))

    def _verify(self, checks: list, step: int | None) -> None:
        """Compare each tensor's checksum after the flush with the sender's (one host sync); DeltaChecksumError."""
        deltas = [c[3] for c in checks if isinstance(c[3], torch.Tensor)]
        sums = iter(torch.stack(deltas).tolist() if deltas else [])
        for name, expected, parts, delta in checks:
            if delta is not None:
                parts = add_parts(parts, *(next(sums) if isinstance(delta, torch.Tensor) else delta))
            got = combine(parts)
            if got != expected:
                where = ("would hold" if self.atomic else "holds")
                raise DeltaChecksumError(f"refused step {step}: tensor {name!r} {where} checksum {got:#x}, the "
                                         f"sender's is {expected}; "
                                         + (f"still serving step {self.served_step}" if self.atomic
                                            else "the rollout is degraded"), tensor=name, step=step)
            self._pending_parts[name] = parts


def _copy_with_parts(target: torch.Tensor, vals: torch.Tensor) -> tuple[int, int]:
    """Write ``vals`` into ``target`` bit for bit and return the checksum parts of what ``target`` now holds."""
    if vals.device != target.device:  # checksum where the bytes arrived, then one copy over
        bits(target).copy_(bits(vals.to(target.device)))
        return tensor_parts(vals)
    src = vals
    nbytes = target.numel() * target.element_size()
    if nbytes % 8 == 0 and src.storage_offset() * src.element_size() % 8 == 0 \
            and target.storage_offset() * target.element_size() % 8 == 0:
        return parts_and_copy(bits(src).view(torch.int64), bits(target).view(torch.int64))
    bits(target).copy_(bits(src))
    return tensor_parts(target)


def _host_kernel(target: torch.Tensor, index: torch.Tensor, vals: torch.Tensor):
    """Return the C library when a sparse write can go through it (three contiguous host tensors), else ``None``."""
    if not all(t.is_cpu and t.is_contiguous() for t in (target, index, vals)):
        return None
    return kernel.library()


def _write(target: torch.Tensor, index: torch.Tensor | None, vals: torch.Tensor) -> None:
    """Write ``vals`` into ``target`` bit for bit: all of it (``index`` None) or at flat int32/int64 ``index``."""
    dst = bits(target)
    src = bits(vals.to(target.device))
    if index is None:
        dst.copy_(src)
        return
    lib = _host_kernel(target, index, vals) if index.dtype == torch.int32 else None
    if lib is not None:
        kernel.apply(lib, dst, index, src, write=True)
    else:
        dst.index_copy_(0, index.to(device=target.device, dtype=torch.int64), src)


def apply_delta_flush(named_tensors: Iterable[tuple[str, torch.Tensor]],
                      target_params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                      atomic: bool = True) -> int | None:
    """Apply one self-contained flush (a whole update) onto ``target_params``; return the step it carries.

    The base step is not checked. ``atomic``: nothing is written unless every checksum matches.
    """
    receiver = DeltaReceiver(target_params, atomic=atomic, served_step=0)
    tensors = dict(named_tensors)
    spec = decode_spec(tensors[SPEC]) if SPEC in tensors else {}
    if isinstance(spec.get("hal"), dict):  # a lone flush: its base is whatever the caller holds
        receiver.served_step = spec["hal"].get("base_step")
        receiver.needs_seed = False
    receiver.apply_flush(tensors.items(), is_last=True)
    return receiver.served_step
