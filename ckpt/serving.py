"""The rollout adapters: where a rollout's received updates go.

:class:`InMemoryRolloutAdapter` keeps received tensors as they come; :class:`ModelRolloutAdapter` loads
updates into a live model in place. The latter keeps every weight of its module as a view into one flat
byte buffer, a *bank*, laid out by :class:`WeightLayout`; a transport given its ``receive_placement`` (the
collective engine) receives straight into the bank.

* ``atomic=True`` (default): a second bank receives the update; once it arrived whole the module is
  re-pointed to it and the banks swap. A failed update leaves the previous weights and step in service.
  Memory: two banks, at fixed addresses.
* ``atomic=False``: one bank, updated in place. A failure once a tensor was received or a placement handed
  out leaves the weights mixed: the adapter serves no step (:attr:`ModelRolloutAdapter.degraded` says why)
  until a complete update arrives.

Before every update, tensors moved behind the adapter's back (sleep / wake_up, ``module.to()``) are
re-pointed to the bank if device, dtype and shape match, else refused. Updates run one at a time and a step
below the served one is refused, so a step never goes backwards."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, AsyncIterator, Iterable, Mapping

import torch
from torch import nn

from ckpt.base import NamedTensor, ReceivePlacement, as_async_stream, check_global_steps, drain
from ckpt.layout import LayoutEntry, WeightLayout, local_weights, named_weights
from ckpt.errors import CheckpointConfigError, TransferError, WeightMismatchError


@dataclasses.dataclass(frozen=True)
class AdapterMemory:
    """What a :class:`ModelRolloutAdapter` holds, in bytes (``banks``: 2 atomic, 1 in place)."""

    model_bytes: int
    banks: int
    bank_bytes: int
    staging_bytes: int
    last_copied_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.banks * self.bank_bytes


class StagingPlacement:
    """The :class:`ReceivePlacement` a :class:`ModelRolloutAdapter` offers its transport: the staging bank."""

    def __init__(self, adapter: ModelRolloutAdapter) -> None:
        self._adapter = adapter

    def target(self, name: str, dtype: torch.dtype, shape: Any) -> torch.Tensor | None:
        """Return tensor ``name``'s view in the staging bank, or ``None`` when it does not match or no update runs."""
        return self._adapter.staging_target(name, dtype, shape)


class ModelRolloutAdapter:
    """Rollout side of a weight update into a live module (see the module overview for the two modes).

    ``module``'s parameters and persistent buffers move into the bank now and stay the same objects; ``device``
    defaults to that of its first tensor. Every update must carry every tensor the module serves. A ``DTensor``
    (a tensor-parallel shard) is served as its local shard. ``agree(ok) -> bool``, if given, runs at the end of
    every update on every rank of a tensor-parallel rollout (blocking, bounded): a rank applies only if all did."""

    def __init__(self, module: nn.Module, atomic: bool = True, device: torch.device | str | None = None,
                 agree: Any = None) -> None:
        if not isinstance(atomic, bool):
            raise CheckpointConfigError(f"atomic must be True (two banks, all-or-nothing) or False (one bank, "
                                        f"updated in place), got {atomic!r}")
        weights = list(local_weights(module))
        if not weights:
            raise CheckpointConfigError(f"{type(module).__name__} has no parameters or buffers to serve")
        self.module, self.atomic, self.agree = module, atomic, agree
        self.device = torch.device(device) if device is not None else weights[0][1].device
        self.layout = WeightLayout(weights)  # the banks' layout, from the module's own tensors
        # allocated once; banks[0] is served, banks[-1] receives
        self.banks = [self.layout.allocate(self.device) for _ in range(2 if self.atomic else 1)]
        self.layout.fill(self.banks[0], weights)
        self.layout.bind(module, self.banks[0])
        # global_steps in service (None before the first update, or in place after a failed one)
        self.served_step: int | None = None
        self.degraded: str | None = None  # why the weights are not a whole step, else None
        self.last_copied_bytes = 0  # bytes the last update copied into place (0: all received in place)
        self.repointed: list[str] = []  # tensors the last update found moved and re-pointed
        self.receive_placement = StagingPlacement(self)  # to hand a transport: receive_weights(..., placement=...)
        self._receiving = False  # an update is consuming its stream and has met no error: placements are given
        self._handed = False  # a placement was handed out during the current update (bytes may have landed)
        self._lock: asyncio.Lock | None = None  # one update at a time, per event loop
        self._lock_loop: asyncio.AbstractEventLoop | None = None

    @property
    def staging(self) -> torch.Tensor:
        """The bank the next update lands in (the served one when not atomic)."""
        return self.banks[-1]

    def memory(self) -> AdapterMemory:
        return AdapterMemory(model_bytes=sum(e.nbytes for e in self.layout.entries.values()),
                             banks=len(self.banks), bank_bytes=self.layout.nbytes,
                             staging_bytes=self.layout.nbytes if self.atomic else 0,
                             last_copied_bytes=self.last_copied_bytes)

    def staging_target(self, name: str, dtype: torch.dtype, shape: Any) -> torch.Tensor | None:
        """Return tensor ``name``'s view in the staging bank while an update is received, else ``None``."""
        entry = self.layout.entries.get(name)
        if not self._receiving or entry is None or entry.dtype != dtype or entry.shape != tuple(shape):
            return None
        self._handed = True
        return self.layout.view(self.staging, name)

    def _moved(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """Return ``(name, module tensor, bank view)`` of every tensor no longer viewing the served bank.

        Raises :class:`WeightMismatchError` for one that cannot be re-pointed (another device, dtype or shape)."""
        served, moved = self.banks[0], []
        for name, tensor in local_weights(self.module):
            entry = self.layout.entries.get(name)
            if entry is None:
                continue
            view = self.layout.view(served, name)
            same = (tensor.device == view.device and tensor.data_ptr() == view.data_ptr()
                    and tensor.dtype == entry.dtype and tuple(tensor.shape) == entry.shape)
            if same:
                continue
            if tensor.device != view.device or tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
                raise WeightMismatchError(
                    f"tensor {name!r} of the served module was moved out of the adapter's bank (e.g. by a sleep/"
                    f"wake_up or module.to()): it is {tensor.dtype} {tuple(tensor.shape)} on {tensor.device}, the "
                    f"bank holds {entry.dtype} {entry.shape} on {view.device}; an update would not reach the "
                    f"weights the module computes with. Move the module back to {view.device} (its tensors are "
                    f"then re-pointed to the bank) or build a new adapter; nothing applied")
            moved.append((name, tensor, view))
        return moved

    def _repoint_moved(self) -> list[str]:
        """Copy every moved tensor's values into the served bank and bind it there; return their names."""
        moved = self._moved()
        with torch.no_grad():
            for _, tensor, view in moved:
                view.copy_(tensor.detach())
                tensor.data = view
        return [name for name, _, _ in moved]

    def _update_lock(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock_loop is not loop:
            self._lock, self._lock_loop = asyncio.Lock(), loop
        return self._lock

    def _refuse_backwards(self, global_steps: int | None) -> None:
        if global_steps is not None and self.served_step is not None and global_steps < self.served_step:
            raise CheckpointConfigError(
                f"global_steps={global_steps} is below the step in service, global_steps={self.served_step}: a "
                f"rollout's step never goes backwards (an older update finished after a newer one?); nothing "
                f"applied")

    async def update_weights(self, weights: AsyncIterator[NamedTensor], global_steps: int | None = None,
                             wire_format: str = "named_tensors", **_verl_kwargs: Any) -> None:
        """Load one update and serve step ``global_steps`` (``None``: the stream's ``global_steps`` attribute).

        Waits for an update already running. The whole stream is consumed even after an error. Raises
        :class:`WeightMismatchError` for an unknown, mismatched or missing tensor; see the module overview for what
        stays in service after a failure."""
        if wire_format != "named_tensors":
            raise CheckpointConfigError(f"ModelRolloutAdapter takes wire_format 'named_tensors', got {wire_format!r}")
        global_steps = check_global_steps(global_steps)
        async with self._update_lock():
            try:
                self._refuse_backwards(global_steps)
                self.repointed = self._repoint_moved()
            except Exception:
                self._agreed(False)
                raise
            await self._apply(weights, global_steps)

    def _agreed(self, ok: bool) -> bool:
        return ok if self.agree is None else bool(self.agree(ok))

    async def _apply(self, weights: AsyncIterator[NamedTensor], global_steps: int | None) -> None:
        staging, seen, copied = self.staging, set(), 0
        entries = self.layout.entries
        error: BaseException | None = None
        self._receiving, self._handed = True, False
        try:
            async for name, tensor in weights:
                if error is not None:
                    continue  # drain: keep the transport in step, apply nothing more
                try:
                    entry = entries.get(name)
                    if entry is None:
                        raise WeightMismatchError(f"received tensor {name!r} is not among the "
                                                  f"{len(entries)} tensors the rollout serves")
                    if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
                        raise WeightMismatchError(f"tensor {name!r}: received {tensor.dtype} {tuple(tensor.shape)}, "
                                                  f"the rollout serves {entry.dtype} {entry.shape}")
                    dst = self.layout.view(staging, name)
                    if dst.data_ptr() != tensor.data_ptr() or dst.device != tensor.device:
                        with torch.no_grad():
                            dst.copy_(tensor)
                        copied += entry.nbytes
                    seen.add(name)
                except WeightMismatchError as exc:
                    error, self._receiving = exc, False
            if error is None and len(seen) != len(entries):
                missing = [n for n in entries if n not in seen]
                error = WeightMismatchError(f"the update lacks tensor {missing[0]!r} ({len(missing)} of "
                                            f"{len(entries)} tensors missing); nothing applied")
            if global_steps is None:
                global_steps = getattr(weights, "global_steps", None)
            if error is None:
                self._refuse_backwards(global_steps)  # the stream's own step, known only now
            if error is None and not self.atomic:
                moved = self._moved()  # moved while the update ran: the bank's new values are not served
                if moved:
                    error = WeightMismatchError(f"tensor {moved[0][0]!r} of the served module was moved out of "
                                                "the adapter's bank while the update ran; the module does not "
                                                "compute with the update")
        except BaseException as exc:  # noqa: BLE001 - every failure (cancellation too) is settled below and re-raised
            error = exc
        finally:
            self._receiving = False
        if not self._agreed(error is None) and error is None:
            error = TransferError("another tensor-parallel rank of this rollout did not receive the update whole; "
                                  "nothing applied")
        if error is not None:
            if not self.atomic and (seen or copied or self._handed):
                self.served_step = None
                self.degraded = (f"update failed part way ({type(error).__name__}: {error}); weights are mixed"
                                 + ("" if seen else " (the transport had written into them before it failed)"))
            raise error
        if self.atomic:
            self.layout.bind(self.module, staging)
            self.banks.reverse()
        self.served_step, self.degraded, self.last_copied_bytes = global_steps, None, copied

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Return the weights in service (views into the served bank)."""
        return dict(self.layout.views(self.banks[0]))


def _unexpected_names(missing: list[str], extra: list[str], expected: int, shown: int = 8) -> str:
    def names(found: list[str]) -> str:
        more = f" and {len(found) - shown} more" if len(found) > shown else ""
        return ", ".join(repr(n) for n in found[:shown]) + more
    parts = []
    if missing:
        parts.append(f"lacks {len(missing)} of the {expected} tensors the rollout expects ({names(missing)})")
    if extra:
        parts.append(f"carries {len(extra)} tensor(s) the rollout does not expect ({names(extra)})")
    return "the update " + " and ".join(parts) + "; nothing applied"


class InMemoryRolloutAdapter:
    """A reference rollout server: holds a state dict and applies updates all-or-nothing.

    ``expected``: ``{name: (shape, dtype)}``, a state dict (the initial weights), or ``None`` (accept anything).
    With it, an update must carry exactly those names, dtypes and shapes. Memory: one copy of the update while
    staging; the rest of a failed stream is drained."""

    def __init__(self, expected: Mapping[str, Any] | None = None) -> None:
        self._weights: dict[str, torch.Tensor] = {}
        self._expected: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
        self.served_step: int | None = None  # global_steps in service (None before the first update)
        if expected is not None:
            self._expected = {}
            for name, spec in expected.items():
                if isinstance(spec, torch.Tensor):
                    self._expected[name] = (tuple(spec.shape), spec.dtype)
                    self._weights[name] = spec.detach().clone()
                elif isinstance(spec, (tuple, list)) and len(spec) == 2 and isinstance(spec[1], torch.dtype):
                    self._expected[name] = (tuple(spec[0]), spec[1])
                else:
                    raise CheckpointConfigError(f"expected[{name!r}] must be a tensor or (shape, dtype), got {spec!r}")

    def _check(self, name: str, tensor: torch.Tensor) -> None:
        if self._expected is None or name not in self._expected:
            return  # an unexpected name is reported with the missing ones once the stream ended
        shape, dtype = self._expected[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise WeightMismatchError(f"tensor {name!r}: received {tensor.dtype} {tuple(tensor.shape)}, "
                                      f"the rollout expects {dtype} {shape}")

    async def update_weights(self, weights: Iterable[NamedTensor] | AsyncIterator[NamedTensor],
                             wire_format: str = "named_tensors", *, global_steps: int | None = None,
                             peft_config: Any = None, **kwargs: Any) -> None:
        """Apply one update all-or-nothing and serve step ``global_steps`` (verl's ``BaseRollout.update_weights``).

        Only ``"named_tensors"`` and ``peft_config=None`` are taken; verl's other keywords are ignored."""
        try:
            if wire_format != "named_tensors":
                raise CheckpointConfigError(f"wire_format must be 'named_tensors', got {wire_format!r}")
            if peft_config is not None:
                raise CheckpointConfigError(f"peft_config must be None (this rollout holds plain weights), "
                                            f"got {type(peft_config).__name__}")
            global_steps = check_global_steps(global_steps)
            staged: dict[str, torch.Tensor] = {}
            extra: list[str] = []
            async for name, tensor in as_async_stream(weights):
                self._check(name, tensor)
                if self._expected is not None and name not in self._expected:
                    extra.append(name)
                else:
                    staged[name] = tensor.detach().clone()
            if self._expected is not None:
                missing = [n for n in self._expected if n not in staged]
                if missing or extra:
                    raise WeightMismatchError(_unexpected_names(missing, extra, len(self._expected)))
        except Exception:
            await drain(weights)  # keep the transport in step, apply nothing
            raise
        if global_steps is None:
            global_steps = getattr(weights, "global_steps", None)
        self._weights.update(staged)
        self.served_step = global_steps

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Return the weights in service (a new dict of the served tensors)."""
        return dict(self._weights)


__all__ = ["AdapterMemory", "InMemoryRolloutAdapter", "LayoutEntry", "ModelRolloutAdapter", "ReceivePlacement",
           "StagingPlacement", "WeightLayout", "named_weights"]
