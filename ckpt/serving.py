"""A rollout that behaves like an inference server: it holds a model and loads updates into it in place.

``ModelRolloutAdapter`` keeps every weight of its module (parameters, then persistent buffers) as a view
into one flat byte buffer, a *bank*, laid out by :class:`WeightLayout` (tensors in order, each at a
64-byte aligned offset). An update is copied into place tensor by tensor, as vLLM's ``load_weights`` does
(``param.copy_(loaded)``), and a transport given the adapter's ``receive_placement`` (the collective
engine) receives straight into the bank, so no byte is copied twice.

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

The rollout lays out its own banks from its own module (:attr:`ModelRolloutAdapter.layout`); a sender that
wants its tensors to land in place publishes in that layout (:meth:`WeightLayout.from_entries` rebuilds it
from the entries the rollout hands over), instead of guessing the rollout's dtypes and order.

Two guards keep the reported step true:

* Weights moved behind the adapter's back (an inference server's sleep / wake_up, ``module.to("cpu")`` and
  back) no longer view the bank an update lands in. Before every update (and after an in-place one) the
  adapter compares each named tensor with its view in the served bank; a tensor that moved within the
  adapter's device, dtype and shape is re-pointed (its current values copied into the bank, then bound to
  it); one on another device, or of another dtype or shape, is refused naming it.
* One update at a time: a second ``update_weights`` waits for the first (an ``asyncio`` lock per adapter),
  and an update whose step is below the served one is refused naming both, so a step never goes backwards.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, AsyncIterator, Iterable, Iterator

import torch
from torch import nn

from ckpt.base import NamedTensor, ReceivePlacement, check_global_steps
from ckpt.bucket import byte_view
from ckpt.layout import ALIGN, AlignedCursor, align
from ckpt.errors import CheckpointConfigError, WeightMismatchError


@dataclasses.dataclass(frozen=True)
class LayoutEntry:
    """Where one tensor lives in a bank: ``offset`` and ``nbytes`` in bytes, its dtype and shape.

    Picklable (a typed message a rollout can hand to its trainer)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class AdapterMemory:
    """What a :class:`ModelRolloutAdapter` holds, in bytes, for memory bounds.

    Attributes:
        model_bytes: the bytes of the weights the module serves (sum of its tensors' ``nbytes``).
        banks: how many banks are allocated (2 atomic, 1 in place).
        bank_bytes: bytes of one bank (the weights, each at a 64-byte aligned offset).
        staging_bytes: bytes held beyond the served bank to receive an update (``bank_bytes`` atomic, 0 in
            place).
        last_copied_bytes: bytes the last applied update copied into place (0: all received in place).
    """

    model_bytes: int
    banks: int
    bank_bytes: int
    staging_bytes: int
    last_copied_bytes: int

    @property
    def total_bytes(self) -> int:
        """Bytes of every bank together (``banks * bank_bytes``)."""
        return self.banks * self.bank_bytes


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
    offsets, so a run of tensors sent straight from one bank lands straight in the other. The receiver's
    layout is the one to agree on: a sender rebuilds it with :meth:`from_entries` from the receiver's
    :attr:`entries` rather than laying out its own model.
    """

    def __init__(self, weights: Any, dtype: torch.dtype | None = None) -> None:
        pairs = named_weights(weights) if isinstance(weights, nn.Module) else weights
        self.entries: dict[str, LayoutEntry] = {}
        """``{name: LayoutEntry}`` in layout order."""
        cursor = AlignedCursor()  # the planner ckpt.bucket lays out a bucket's packed tensors with
        for name, tensor in pairs:
            if name in self.entries:
                raise CheckpointConfigError(f"tensor name {name!r} appears twice")
            dt = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            nbytes = tensor.numel() * dt.itemsize
            self.entries[name] = LayoutEntry(name, dt, tuple(tensor.shape), cursor.place(nbytes), nbytes)
        self.nbytes = cursor.total
        """Bytes of one bank."""

    @classmethod
    def from_entries(cls, entries: Iterable[LayoutEntry]) -> WeightLayout:
        """The layout another side built, from its entries (e.g. a rollout's ``layout.entries.values()``
        handed to its trainer), offsets kept as given.

        Raises:
            CheckpointConfigError: a name twice, an entry that is not a :class:`LayoutEntry`, an offset not
                64-byte aligned, ``nbytes`` that disagrees with dtype and shape, or entries that overlap or
                are not in ascending offset order (names the entry).
        """
        layout = cls([])
        end = 0
        for entry in entries:
            if not isinstance(entry, LayoutEntry):
                raise CheckpointConfigError(f"layout entries must be LayoutEntry, got {type(entry).__name__}")
            numel = 1
            for d in entry.shape:
                numel *= d
            if entry.name in layout.entries:
                raise CheckpointConfigError(f"tensor name {entry.name!r} appears twice")
            if entry.offset % ALIGN or entry.offset < end or entry.nbytes != numel * entry.dtype.itemsize:
                raise CheckpointConfigError(
                    f"layout entry {entry.name!r} (offset {entry.offset}, {entry.nbytes} bytes, {entry.dtype} "
                    f"{entry.shape}) must start at a multiple of {ALIGN} bytes at or after byte {end} and hold "
                    f"{numel * entry.dtype.itemsize} bytes")
            layout.entries[entry.name] = entry
            end = entry.offset + entry.nbytes
        layout.nbytes = align(end)
        return layout

    @property
    def slots(self) -> dict[str, LayoutEntry]:
        """Kept for callers of the earlier name: :attr:`entries`."""
        return self.entries

    def allocate(self, device: torch.device | str) -> torch.Tensor:
        """A new bank on ``device``: flat ``uint8`` of :attr:`nbytes`, zero-filled so its pages are resident."""
        return torch.zeros(max(self.nbytes, ALIGN), dtype=torch.uint8, device=device)

    def view(self, bank: torch.Tensor, name: str) -> torch.Tensor:
        """Tensor ``name`` inside ``bank`` (no copy)."""
        entry = self.entries[name]
        return byte_view(bank, entry.offset, entry.dtype, entry.shape)

    def views(self, bank: torch.Tensor) -> list[NamedTensor]:
        """``(name, view into bank)`` for every tensor, in layout order: contiguous, back to back.

        A list (every view exists at once), so an engine may send runs of them straight from the bank
        (:func:`ckpt.bucket.plan_messages` copies the tensors of any other iterable as they are yielded)."""
        return [(name, self.view(bank, name)) for name in self.entries]

    def fill(self, bank: torch.Tensor, weights: Any) -> None:
        """Copy (and cast) ``weights`` (pairs or a module) into ``bank``.

        Raises:
            WeightMismatchError: a name that is not in the layout, or a shape that differs from its entry's
                (``copy_`` would broadcast it silently).
        """
        pairs = named_weights(weights) if isinstance(weights, nn.Module) else weights
        with torch.no_grad():
            for name, tensor in pairs:
                entry = self.entries.get(name)
                if entry is None:
                    raise WeightMismatchError(f"tensor {name!r} is not among the {len(self.entries)} tensors "
                                              "of the layout")
                if tuple(tensor.shape) != entry.shape:
                    raise WeightMismatchError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the layout "
                                              f"holds {entry.shape}")
                self.view(bank, name).copy_(tensor.detach())

    def bind(self, module: nn.Module, bank: torch.Tensor | None) -> None:
        """Point every named tensor of ``module`` at its view in ``bank`` (``.data`` assignment: the same
        ``Parameter`` objects, tied ones included); ``None`` points them at empty placeholders (frees the
        module's hold on a bank)."""
        for name, tensor in named_weights(module):
            if name not in self.entries:
                continue
            if bank is None:
                tensor.data = torch.empty(0, dtype=self.entries[name].dtype, device=tensor.device)
            else:
                tensor.data = self.view(bank, name)


class StagingPlacement:
    """The :class:`ReceivePlacement` a :class:`ModelRolloutAdapter` offers its transport: the staging bank.

    ``target(name, dtype, shape)`` is the tensor's view in the bank the running update lands in, or ``None``
    (see :meth:`ModelRolloutAdapter.update_weights`).
    """

    def __init__(self, adapter: ModelRolloutAdapter) -> None:
        self._adapter = adapter

    def target(self, name: str, dtype: torch.dtype, shape: Any) -> torch.Tensor | None:
        """Where the transport may write tensor ``name`` (``dtype``, ``shape``): its view in the staging bank,
        or ``None`` when the name, dtype or shape is not what the module serves (the update then fails on
        that tensor), or when no update is consuming its stream without error (before
        :meth:`ModelRolloutAdapter.update_weights` started iterating, after it failed or ended: what a
        transport receives then, e.g. while the rest of a failed update is drained, goes to its own buffers,
        never into the weights)."""
        return self._adapter.staging_target(name, dtype, shape)


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
    The layout is the adapter's own (:attr:`layout`, built from ``module``); a sender that wants to write
    straight into the banks publishes in it (:meth:`WeightLayout.from_entries`).
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
        """The banks' layout, built from the module's own tensors (names, dtypes, shapes, in order)."""
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
        self.repointed: list[str] = []
        """Names of the tensors the last update found moved out of the served bank and re-pointed to it."""
        self.receive_placement = StagingPlacement(self)
        """The :class:`ReceivePlacement` to hand a transport (``receive_weights(..., placement=...)``)."""
        self._receiving = False  # an update is consuming its stream and has met no error: placements are given
        self._handed = False  # a placement was handed out during the current update (bytes may have landed)
        self._lock: asyncio.Lock | None = None  # one update at a time, per event loop
        self._lock_loop: asyncio.AbstractEventLoop | None = None

    @property
    def staging(self) -> torch.Tensor:
        """The bank the next update lands in (the served one when not atomic)."""
        return self.banks[-1]

    def memory(self) -> AdapterMemory:
        """What the adapter holds, in bytes (see :class:`AdapterMemory`)."""
        return AdapterMemory(model_bytes=sum(e.nbytes for e in self.layout.entries.values()),
                             banks=len(self.banks), bank_bytes=self.layout.nbytes,
                             staging_bytes=self.layout.nbytes if self.atomic else 0,
                             last_copied_bytes=self.last_copied_bytes)

    def staging_target(self, name: str, dtype: torch.dtype, shape: Any) -> torch.Tensor | None:
        """Tensor ``name``'s view in the staging bank while an update is being received, else ``None`` (see
        :meth:`StagingPlacement.target`, the transports' way in)."""
        entry = self.layout.entries.get(name)
        if not self._receiving or entry is None or entry.dtype != dtype or entry.shape != tuple(shape):
            return None
        self._handed = True
        return self.layout.view(self.staging, name)

    def _moved(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """``(name, module tensor, its view in the served bank)`` of every named tensor that no longer views
        the served bank.

        Raises:
            WeightMismatchError: a moved tensor is on another device than the banks, or of another dtype or
                shape (it cannot be re-pointed; names it and both places).
        """
        served, moved = self.banks[0], []
        for name, tensor in named_weights(self.module):
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
        """Copy every moved tensor's current values into its view in the served bank and bind it there (the
        module computes with the same values, now where updates land); returns their names."""
        moved = self._moved()
        with torch.no_grad():
            for _, tensor, view in moved:
                view.copy_(tensor.detach())
                tensor.data = view
        return [name for name, _, _ in moved]

    def _update_lock(self) -> asyncio.Lock:
        """The running loop's update lock (a new loop, e.g. a second ``asyncio.run``, gets a new one)."""
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

        ``wire_format`` is verl's keyword: only ``"named_tensors"`` (``(name, tensor)`` pairs) is taken.

        One update at a time: a call made while another runs waits for it (in the same event loop). Before
        the stream is read, tensors the module holds outside the served bank (moved by a sleep/wake_up or
        ``module.to()``) are re-pointed to it, their values kept (:attr:`repointed` names them).

        Each received tensor is copied into its place in the staging bank unless the transport already
        wrote it there (through :attr:`receive_placement`). The whole stream is consumed even after an
        error, so the transport stays in step.

        Raises:
            CheckpointConfigError: another ``wire_format``, ``global_steps`` not ``None`` or an int >= 0, or
                below the step in service (names both) (raised before the stream is read: nothing changes).
            WeightMismatchError: a module tensor moved to another device, dtype or shape (names it; raised
                before the stream is read); an unknown name, a dtype or shape that differs from the module's,
                or a tensor the update lacks (names it). Anything the stream raises (VersionMismatchError,
                TransferError). Atomic: the previous weights and step stay in service. In place: the
                adapter serves no step until a complete update (see :attr:`degraded`) once a tensor was
                received or a placement handed out; a failure before either (e.g. the collective engine's
                step mismatch, found on the first metadata) leaves the previous weights and step in service.
        """
        if wire_format != "named_tensors":
            raise CheckpointConfigError(f"ModelRolloutAdapter takes wire_format 'named_tensors', got {wire_format!r}")
        global_steps = check_global_steps(global_steps)
        async with self._update_lock():
            self._refuse_backwards(global_steps)
            self.repointed = self._repoint_moved()
            await self._apply(weights, global_steps)

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
        """The weights in service, ``{name: tensor}`` (views into the served bank)."""
        return dict(self.layout.views(self.banks[0]))


__all__ = ["AdapterMemory", "LayoutEntry", "ModelRolloutAdapter", "ReceivePlacement", "StagingPlacement",
           "WeightLayout", "named_weights"]
