"""A rollout that behaves like an inference server: it holds a model and loads updates into it in place.

``ModelRolloutAdapter`` keeps every weight of its module (parameters, then persistent buffers) as a view
into one flat byte buffer, a *bank*, laid out by :class:`WeightLayout` (tensors in order, each at a
64-byte aligned offset). An update is copied into place tensor by tensor, as vLLM's ``load_weights`` does
(``param.copy_(loaded)``), and a transport that accepts a ``placement`` (the collective engine) receives
straight into the bank, so no byte is copied twice.

Two ways to apply, chosen at construction:

* ``atomic=True`` (default): a second bank, allocated once, receives the update; once the stream ended
  without error and every tensor arrived, the module's tensors are re-pointed to it (``param.data``) and the
  two banks swap roles. A failed or partial update leaves the previous weights and step in service.
  Memory: two banks (2 x the weights' bytes); both keep their addresses for the adapter's lifetime.
* ``atomic=False``: the update lands in the served bank itself. Memory: one bank. An update that fails
  part way leaves the weights mixed; the adapter then serves no step (``served_step is None``) and says why
  in :attr:`ModelRolloutAdapter.degraded`, until a complete update arrives. "Part way" starts as soon as a
  tensor was received or a placement was handed to the transport: the collective engine writes a message
  into its placements before it yields that message's tensors, so a sender that dies then has overwritten
  part of the served weights although the adapter received nothing. Only a failure before either (a step
  mismatch the engine detects on the first metadata, a bad argument) keeps the previous step in service.
  All-or-nothing under a failure mid-transfer needs the old weights and the received part of the new ones
  at once, so it cannot be had in one bank plus a few buckets.
"""

from __future__ import annotations

import dataclasses
from typing import Any, AsyncIterator, Iterator

import torch
from torch import nn

from ckpt.base import NamedTensor, check_global_steps
from ckpt.bucket import byte_view
from ckpt.layout import ALIGN, AlignedCursor
from ckpt.errors import CheckpointConfigError, WeightMismatchError


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one tensor lives in a bank: ``offset`` and ``nbytes`` in bytes, its dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def named_weights(module: nn.Module) -> Iterator[NamedTensor]:
    """``(name, tensor)`` of what a module serves and a trainer publishes: parameters (a tied weight once,
    under its first name, as ``named_parameters`` gives it), then persistent buffers."""
    yield from module.named_parameters()
    persistent = set(module.state_dict(keep_vars=True))
    for name, buf in module.named_buffers():
        if name in persistent:
            yield name, buf


class WeightLayout:
    """The flat layout of named tensors: each at the next 64-byte aligned offset, in the given order.

    Args:
        weights: ``(name, tensor)`` pairs (only names, dtypes and shapes are read), or a module (its
            :func:`named_weights`).
        dtype: if given, floating-point tensors are laid out as this dtype (e.g. a trainer's fp32 master
            weights laid out as the bf16 it publishes).

    Raises:
        CheckpointConfigError: two tensors share a name.

    A sender and a receiver that lay out the same names in the same order agree byte for byte on relative
    offsets, so a run of tensors sent straight from one bank lands straight in the other.
    """

    def __init__(self, weights: Any, dtype: torch.dtype | None = None) -> None:
        pairs = named_weights(weights) if isinstance(weights, nn.Module) else weights
        self.slots: dict[str, Slot] = {}
        cursor = AlignedCursor()  # the planner ckpt.bucket lays out a bucket's packed tensors with
        for name, tensor in pairs:
            if name in self.slots:
                raise CheckpointConfigError(f"tensor name {name!r} appears twice")
            dt = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            nbytes = tensor.numel() * torch.empty((), dtype=dt).element_size()
            self.slots[name] = Slot(name, dt, tuple(tensor.shape), cursor.place(nbytes), nbytes)
        self.nbytes = cursor.total
        """Bytes of one bank."""

    def allocate(self, device: torch.device | str) -> torch.Tensor:
        """A new bank on ``device``: flat ``uint8`` of :attr:`nbytes`, zero-filled so its pages are resident."""
        return torch.zeros(max(self.nbytes, ALIGN), dtype=torch.uint8, device=device)

    def view(self, bank: torch.Tensor, name: str) -> torch.Tensor:
        """Tensor ``name`` inside ``bank`` (no copy)."""
        slot = self.slots[name]
        return byte_view(bank, slot.offset, slot.dtype, slot.shape)

    def views(self, bank: torch.Tensor) -> list[NamedTensor]:
        """``(name, view into bank)`` for every tensor, in layout order: contiguous, back to back.

        A list (every view exists at once), so an engine may send runs of them straight from the bank
        (:func:`ckpt.bucket.plan_messages` copies the tensors of any other iterable as they are yielded)."""
        return [(name, self.view(bank, name)) for name in self.slots]

    def fill(self, bank: torch.Tensor, weights: Any) -> None:
        """Copy (and cast) ``weights`` (pairs or a module) into ``bank``; names must be in the layout."""
        pairs = named_weights(weights) if isinstance(weights, nn.Module) else weights
        with torch.no_grad():
            for name, tensor in pairs:
                self.view(bank, name).copy_(tensor.detach())

    def bind(self, module: nn.Module, bank: torch.Tensor | None) -> None:
        """Point every named tensor of ``module`` at its view in ``bank`` (``.data`` assignment: the same
        ``Parameter`` objects, tied ones included); ``None`` points them at empty placeholders (frees the
        module's hold on a bank)."""
        for name, tensor in named_weights(module):
            if name not in self.slots:
                continue
            slot = self.slots[name]
            if bank is None:
                tensor.data = torch.empty(0, dtype=slot.dtype, device=tensor.device)
            else:
                tensor.data = self.view(bank, name)


class ModelRolloutAdapter:
    """Rollout side of a weight update into a live module (see the module docstring for the two modes).

    Args:
        module: the served model (e.g. a bf16 ``Qwen2ForCausalLM``); its parameters and persistent buffers
            are moved into the adapter's bank now (their values kept) and stay the same objects.
        atomic: ``True``: two banks and all-or-nothing (default); ``False``: one bank updated in place.
        device: where the banks live; default the device of the module's first tensor.

    Raises:
        CheckpointConfigError: the module has no tensors, or ``atomic`` is not a ``bool`` (a ``ValueError``
            naming the value: ``atomic="no"`` would otherwise be truthy, i.e. atomic).

    Every update must carry every tensor the module serves (a missing one is a :class:`WeightMismatchError`
    naming it, and nothing is applied in atomic mode): a sender that lost a shard is caught, not served.
    """

    def __init__(self, module: nn.Module, atomic: bool = True, device: torch.device | str | None = None) -> None:
        if not isinstance(atomic, bool):
            raise CheckpointConfigError(f"atomic must be True (two banks, all-or-nothing) or False (one bank, "
                                        f"updated in place), got {atomic!r}")
        weights = list(named_weights(module))
        if not weights:
            raise CheckpointConfigError(f"{type(module).__name__} has no parameters or buffers to serve")
        self.module, self.atomic = module, atomic
        self.device = torch.device(device) if device is not None else weights[0][1].device
        self.layout = WeightLayout(weights)
        self.banks = [self.layout.allocate(self.device) for _ in range(2 if self.atomic else 1)]
        """The banks (flat ``uint8``), allocated once; ``banks[0]`` is served, ``banks[-1]`` receives."""
        self.layout.fill(self.banks[0], weights)
        self.layout.bind(module, self.banks[0])
        self.served_step: int | None = None
        """The ``global_steps`` of the weights in service (``None`` before the first update, or in place
        after a failed one)."""
        self.degraded: str | None = None
        """Why the weights are not a whole step (in-place mode after a failed update), else ``None``."""
        self.last_copied_bytes = 0
        """Bytes the last update copied into place (0 when the transport received everything in place)."""
        self._receiving = False  # an update is consuming its stream and has met no error: placements are given
        self._handed = False  # a placement was handed out during the current update (bytes may have landed)

    @property
    def staging(self) -> torch.Tensor:
        """The bank the next update lands in (the served one when not atomic)."""
        return self.banks[-1]

    def placement(self, name: str, dtype: torch.dtype, shape: Any) -> torch.Tensor | None:
        """Where the transport may write tensor ``name`` directly: its view in the staging bank, or ``None``
        when the name, dtype or shape is not what the module serves (the update then fails on that tensor),
        or when no update is consuming its stream without error (before :meth:`update_weights` started
        iterating, after it failed or ended: what a transport receives then, e.g. while the rest of a failed
        update is drained, goes to its own buffers, never into the weights)."""
        slot = self.layout.slots.get(name)
        if not self._receiving or slot is None or slot.dtype != dtype or slot.shape != tuple(shape):
            return None
        self._handed = True
        return self.layout.view(self.staging, name)

    async def update_weights(self, weights: AsyncIterator[NamedTensor], global_steps: int | None = None,
                             wire_format: str = "named_tensors", **_verl_kwargs: Any) -> None:
        """Load one update and serve step ``global_steps`` (``None``: the stream's ``global_steps`` attribute).

        ``wire_format`` is verl's keyword: only ``"named_tensors"`` (``(name, tensor)`` pairs) is taken.

        Each received tensor is copied into its place in the staging bank unless the transport already
        wrote it there. The whole stream is consumed even after an error, so the transport stays in step.

        Raises:
            CheckpointConfigError: another ``wire_format``, or ``global_steps`` not ``None`` or an int >= 0
                (raised before the stream is read: nothing changes).
            WeightMismatchError: an unknown name, a dtype or shape that differs from the module's, or a
                tensor the update lacks (names it). Anything the stream raises (VersionMismatchError,
                TransferError). Atomic: the previous weights and step stay in service. In place: the
                adapter serves no step until a complete update (see :attr:`degraded`) once a tensor was
                received or a placement handed out; a failure before either (e.g. the collective engine's
                step mismatch, found on the first metadata) leaves the previous weights and step in service.
        """
        if wire_format != "named_tensors":
            raise CheckpointConfigError(f"ModelRolloutAdapter takes wire_format 'named_tensors', got {wire_format!r}")
        global_steps = check_global_steps(global_steps)
        staging, seen, copied = self.staging, set(), 0
        error: BaseException | None = None
        self._receiving, self._handed = True, False
        try:
            async for name, tensor in weights:
                if error is not None:
                    continue  # drain: keep the transport in step, apply nothing more
                try:
                    slot = self.layout.slots.get(name)
                    if slot is None:
                        raise WeightMismatchError(f"received tensor {name!r} is not among the "
                                                  f"{len(self.layout.slots)} tensors the rollout serves")
                    if tensor.dtype != slot.dtype or tuple(tensor.shape) != slot.shape:
                        raise WeightMismatchError(f"tensor {name!r}: received {tensor.dtype} {tuple(tensor.shape)}, "
                                                  f"the rollout serves {slot.dtype} {slot.shape}")
                    dst = self.layout.view(staging, name)
                    if dst.data_ptr() != tensor.data_ptr() or dst.device != tensor.device:
                        with torch.no_grad():
                            dst.copy_(tensor)
                        copied += slot.nbytes
                    seen.add(name)
                except WeightMismatchError as exc:
                    error, self._receiving = exc, False
            if error is None and len(seen) != len(self.layout.slots):
                missing = [n for n in self.layout.slots if n not in seen]
                error = WeightMismatchError(f"the update lacks tensor {missing[0]!r} ({len(missing)} of "
                                            f"{len(self.layout.slots)} tensors missing); nothing applied")
        except BaseException as exc:
            error = exc
        finally:
            self._receiving = False
        if error is not None:
            if not self.atomic and (seen or copied or self._handed):
                self.served_step = None
                self.degraded = (f"update failed part way ({type(error).__name__}: {error}); weights are mixed"
                                 + ("" if seen else " (the transport had written into them before it failed)"))
            raise error
        if global_steps is None:
            global_steps = getattr(weights, "global_steps", None)
        if self.atomic:
            self.layout.bind(self.module, staging)
            self.banks.reverse()
        self.served_step, self.degraded, self.last_copied_bytes = global_steps, None, copied

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights in service, ``{name: tensor}`` (views into the served bank)."""
        return dict(self.layout.views(self.banks[0]))


__all__ = ["ModelRolloutAdapter", "Slot", "WeightLayout", "named_weights"]
