"""The rollout adapters: where a rollout's received updates go.

:class:`InMemoryRolloutAdapter` keeps the received tensors as they come (tests, simple rollouts).
:class:`ModelRolloutAdapter` behaves like an inference server: it holds a model and loads updates into it in place.

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
from typing import Any, AsyncIterator, Iterable, Mapping

import torch
from torch import nn

from ckpt.base import NamedTensor, ReceivePlacement, as_async_stream, check_global_steps, drain
from ckpt.layout import LayoutEntry, WeightLayout, named_weights
from ckpt.errors import CheckpointConfigError, WeightMismatchError


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


def _unexpected_names(missing: list[str], extra: list[str], expected: int, shown: int = 8) -> str:
    """What an update got wrong about the names of ``expected`` tensors (at most ``shown`` of each)."""
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

    Args:
        expected: what the rollout expects, ``{name: (shape, dtype)}``, or a state dict
            ``{name: tensor}`` (its tensors become the initial weights, step ``None``), or ``None`` (accept
            anything). With an expectation, every update must carry exactly the expected names, each with
            its dtype and shape: a disagreement raises :class:`WeightMismatchError` naming the tensor, and
            an update that lacks expected names or brings others raises it naming them (all of both).

    An update stages a private copy of every received tensor (so views into a transport buffer may be
    reused afterwards) and swaps weights and step in only once the stream ended without error and, with
    an expectation, every expected tensor arrived; on any failure the previous weights and step stay in
    service, and the rest of the stream is drained so the transport stays in step. Without an expectation,
    names an update does not carry keep their previous tensors.
    Memory: one extra copy of the update while staging.
    """

    def __init__(self, expected: Mapping[str, Any] | None = None) -> None:
        self._weights: dict[str, torch.Tensor] = {}
        self._expected: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
        self.served_step: int | None = None
        """The ``global_steps`` of the weights in service (``None`` before the first update)."""
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
        """Apply one update all-or-nothing and serve step ``global_steps`` (``None``: the stream's
        ``global_steps`` attribute if it has one). The signature is verl's ``BaseRollout.update_weights``.

        Args:
            weights: async or plain iterable of ``(name, tensor)``.
            wire_format: ``"named_tensors"`` (verl's other format, ``"delta_flush"``, is refused).
            global_steps: the step these weights are (keyword, as verl passes it).
            peft_config: must be ``None`` (a LoRA adapter cannot be applied to plain weights).
            kwargs: verl's further keywords (``base_sync_done``, ...), accepted and ignored.

        Raises:
            WeightMismatchError: a dtype or shape disagrees with ``expected`` (names the tensor), or the
                update lacks expected tensors or carries unexpected ones (names them).
            CheckpointConfigError: another ``wire_format``, a ``peft_config`` or a bad ``global_steps``.
            Anything the stream raises (VersionMismatchError, TransferError). In every case the previous
            weights and step stay in service, and the rest of the stream is drained.
        """
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
        """The weights in service, ``{name: tensor}`` (a new dict; the tensors are the served ones)."""
        return dict(self._weights)


__all__ = ["AdapterMemory", "InMemoryRolloutAdapter", "LayoutEntry", "ModelRolloutAdapter", "ReceivePlacement",
           "StagingPlacement", "WeightLayout", "named_weights"]
