"""BaseEngine: verl's ``to(device, model=True, optimizer=True, grad=True)`` offload, shared by every engine.

The public method holds the logic (flag rule, pinned reusable host buffers, non-blocking copies, one
synchronize, emptying the cache); a subclass only yields :class:`engines.tensor_holders.TensorHolder` objects
from three small hooks.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Iterator

import torch
from torch import nn

import hal
from hal import DeviceSpec
from engines.errors import EngineStateError, OffloadError
from engines.host_buffers import SLAB_BYTES, HostBufferPool, pin_memory_supported
from engines.tensor_home import TensorHome, device_type_of
from engines.tensor_holders import TensorHolder

_PARTS = ("model", "grad", "optimizer")


class BaseEngine(abc.ABC):
    """A trainable module plus optimizer that can move its parts between its device and the host.

    Subclasses implement the three ``_*_holders`` hooks and :meth:`_per_tensor_params`. ``torch_device`` is the
    index given in ``device``, else :func:`hal.get_device`'s; ``last_moved_bytes`` the bytes the last :meth:`to`
    copied.
    """

    module: nn.Module
    optimizer: torch.optim.Optimizer | None

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None, device: hal.device.DeviceLike):
        self.device: DeviceSpec = hal.resolve_device(device)
        self.torch_device: torch.device = hal.get_device(device)
        self.module = module
        self.optimizer = optimizer
        self.host_buffers = HostBufferPool(pin=pin_memory_supported(self.device))
        self.last_moved_bytes = 0
        self._offloaded: dict[str, set] = {part: set() for part in _PARTS}
        self._optimizer_home = self.torch_device.type

    # ----------------------------------------------------------------- hooks for subclasses
    @abc.abstractmethod
    def _model_holders(self) -> Iterator[TensorHolder]:
        """Yield holders of every parameter and buffer (local shards for sharded engines), tied weights once."""

    @abc.abstractmethod
    def _grad_holders(self) -> Iterator[TensorHolder]:
        """Yield holders of every parameter's gradient (empty holders for parameters without one)."""

    @abc.abstractmethod
    def _optimizer_holders(self) -> Iterator[TensorHolder]:
        """Yield holders of every optimizer-state tensor (none before the first step)."""

    @abc.abstractmethod
    def _per_tensor_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` for weight sync: full, unsharded tensors in ``state_dict`` order."""

    def get_per_tensor_param(self, layered_summon: bool = False, base_sync_done: bool = True,
                             **kwargs: Any) -> tuple[Iterator[tuple[str, torch.Tensor]], dict[str, Any] | None]:
        """Return ``(generator of (name, tensor), peft_config)`` for weight sync, as verl's engines do.

        Full, unsharded tensors in ``state_dict`` order. A peft LoRA module gives its ``peft_config`` (a dict) and,
        with ``base_sync_done``, only the adapter under ``get_peft_model_state_dict``'s names, else the base under
        plain names; any other module gives every tensor and ``None``."""
        config = getattr(self.module, "peft_config", None)
        if not isinstance(config, dict) or "default" not in config:
            return self._per_tensor_params(), None
        from peft import get_peft_model_state_dict

        if base_sync_done:
            return iter(get_peft_model_state_dict(self.module).items()), config["default"].to_dict()
        prefix = "base_model.model."
        base = ((name.removeprefix(prefix).replace(".base_layer", ""), t) for name, t in self._per_tensor_params()
                if ".lora_" not in name)
        return base, config["default"].to_dict()

    def _before_move(self) -> None:
        """Run once before tensors move (FSDP reshards here)."""

    def _after_move(self) -> None:
        """Run once after tensors moved and copies completed."""

    # ----------------------------------------------------------------- public API
    def to(self, device: str | torch.device | DeviceSpec, model: bool = True, optimizer: bool = True,
           grad: bool = True) -> None:
        """Move parameters (and buffers), gradients and optimizer states to ``device``, each independently.

        ``device`` is ``"cpu"`` or this engine's own device; ``grad`` requires ``model`` (verl's rule); both else
        raise OffloadError. Offloads copy into reused host buffers (pinned where the kind allows) and empty the
        kind's cache, so ``memory_allocated`` drops by the bytes moved; tensors are valid on return. Parameters
        keep their identity; calling it twice is safe. Host scalars like Adam's ``step`` stay on the host.
        """
        if grad and not model:
            raise OffloadError(
                f"to({device!r}, model={model}, optimizer={optimizer}, grad={grad}): gradient buffers move only "
                "with the model; pass model=True or grad=False")
        target = self._resolve_target(device)
        self.last_moved_bytes = 0
        if self.device.host_memory:
            return
        offload = hal.is_host(target)
        self._before_move()
        hooks = {"model": self._model_holders, "grad": self._grad_holders, "optimizer": self._optimizer_holders}
        wanted = {"model": model, "grad": grad, "optimizer": optimizer}
        moved = 0
        holders = [(part, holder) for part in _PARTS if wanted[part] for holder in hooks[part]()]
        if offload:  # the host buffers a first offload needs come from a few slabs (HostBufferPool.reserve)
            self.host_buffers.reserve(((holder.key, t) for _, holder in holders
                                       if (t := holder.get()) is not None and not t.is_cpu), SLAB_BYTES)
        with torch.no_grad():  # a DTensor's local shard may require grad; its copies must not join a graph
            for part, holder in holders:
                moved += self._move(part, holder, target, offload)
        if optimizer and self.optimizer is not None:
            self._optimizer_home = target.type
        if moved:  # on this engine's device, which need not be the current one
            own = f"{self.device.kind}:{self.torch_device.index}"
            hal.synchronize(own)  # non-blocking copies complete before anyone reads the tensors
            if offload:
                hal.empty_cache(own)
        self.last_moved_bytes = moved
        self._after_move()

    def tensor_home(self) -> TensorHome:
        """Return where parameters, optimizer states and gradients live now."""
        model = device_type_of(t for t in (s.get() for s in self._model_holders()) if t is not None)
        grad = device_type_of(t for t in (s.get() for s in self._grad_holders()) if t is not None)
        optimizer = None
        if self.optimizer is not None:
            states = []
            for holder in self._optimizer_holders():
                t = holder.get()
                host_scalar = t.dim() == 0 and t.is_cpu
                if not host_scalar or holder.key in self._offloaded["optimizer"]:
                    states.append(t)
            optimizer = device_type_of(states) or self._optimizer_home
        return TensorHome(model=model, optimizer=optimizer, grad=grad)

    def train_step(self, loss_fn: Callable[[nn.Module], torch.Tensor]) -> float:
        """Run one optimizer step (``zero_grad(set_to_none=True)``, ``loss_fn(module)``, backward, ``step()``).

        Returns the loss as a float (waits for the device); EngineStateError without an optimizer or while offloaded.
        """
        if self.optimizer is None:
            raise EngineStateError("train_step needs an optimizer; this engine was built without one")
        self._check_onloaded()
        self.optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(self.module)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def release_host_buffers(self) -> None:
        """Drop host buffers not in use (onloaded tensors'); offloaded tensors keep theirs."""
        if not any(self._offloaded.values()):
            self.host_buffers.clear()

    # ----------------------------------------------------------------- internals
    def _check_onloaded(self) -> None:
        for part in ("model", "optimizer"):
            if self._offloaded[part] and not self.device.host_memory:
                raise EngineStateError(
                    f"{part} tensors are offloaded to cpu ({len(self._offloaded[part])} of them); "
                    f"call to({self.device.kind!r}) before training")

    def _resolve_target(self, device: str | torch.device | DeviceSpec) -> torch.device:
        if not isinstance(device, (str, torch.device, DeviceSpec)):
            raise OffloadError(f"to(device={device!r}): expected a kind name, 'cpu', 'kind:index', torch.device "
                               "or DeviceSpec")
        try:
            kind, index = hal.split_device(device)
        except hal.HalError as exc:
            raise OffloadError(f"to(device={device!r}): {exc}") from exc
        name = kind.kind if isinstance(kind, DeviceSpec) else kind
        if name in (self.device.kind, self.device.name) and not self.device.host_memory:
            if index is not None and index != self.torch_device.index:
                raise OffloadError(
                    f"to(device={device!r}): this engine lives on {self.torch_device}; to() moves it between "
                    f"the host and that device only. Accepted: 'cpu', {self.device.kind!r}, "
                    f"{self.device.name!r} or '{self.torch_device}'")
            return self.torch_device
        if name in (self.device.kind, self.device.name):  # a host kind's own name
            target = torch.device("cpu")
        else:  # another kind: only a host kind (the cpu kind, a plugin's) is a place to offload to
            try:
                spec = hal.resolve_device(name)
            except hal.HalError as exc:
                raise OffloadError(f"to(device={device!r}): {exc}") from exc
            if not spec.host_memory:
                raise OffloadError(
                    f"to(device={device!r}): this engine trains on {self.device.kind!r}; accepted: 'cpu', "
                    f"{self.device.kind!r} or {self.device.name!r}")
            target = torch.device("cpu")
        if index not in (None, 0):
            raise OffloadError(f"to(device={device!r}): the host has one device, index 0; got index {index}")
        return target

    def _move(self, part: str, holder: TensorHolder, target: torch.device, offload: bool) -> int:
        """Move one holder's tensor; return the bytes copied (0 if it was empty or already there)."""
        t = holder.get()
        if t is None:
            return 0
        pin = self.host_buffers.pin
        if offload:
            if t.is_cpu:
                return 0
            host = self.host_buffers.get(holder.key, t)
            host.copy_(t, non_blocking=pin)
            holder.set(host)
            self._offloaded[part].add(holder.key)
        else:
            if not t.is_cpu or holder.key not in self._offloaded[part]:
                return 0
            if holder.load is not None:
                holder.load(t, target, pin)
            else:
                holder.set(t.to(target, non_blocking=pin))
            self._offloaded[part].discard(holder.key)
        return t.numel() * t.element_size()
