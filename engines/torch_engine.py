"""TorchEngine: a plain ``nn.Module`` (or a DDP-wrapped one) plus a ``torch.optim`` optimizer."""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

import hal
from engines.base import BaseEngine
from engines.errors import EngineStateError
from engines.tensor_holders import (TensorHolder, FreedStorages, data_holder, module_grad_holders, module_holders, optimizer_holders,
                           storage_holder)


def _unwrap(module: nn.Module) -> nn.Module:
    """Return the user's module inside a DDP wrapper, else ``module``."""
    inner = getattr(module, "module", None)
    if isinstance(module, nn.parallel.DistributedDataParallel) and isinstance(inner, nn.Module):
        return inner
    return module


class TorchEngine(BaseEngine):
    """A module and an optional optimizer on one device kind, single process or DDP.

    Parameters move to ``device`` in place (``.data`` swap), so the optimizer's references stay valid; for DDP
    wrap a module already on the device. DDP parameters offload by freeing device storage in place
    (:func:`engines.tensor_holders.storage_holder`) so the reducer's hooks survive.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 device: hal.device.DeviceLike = None):
        super().__init__(module, optimizer, device)
        self._storage = FreedStorages() if _unwrap(module) is not module else None
        with torch.no_grad():
            for holder in module_holders(_unwrap(module)):
                t = holder.get()
                if t.device != self.torch_device:
                    holder.set(t.to(self.torch_device))
            for holder in self._optimizer_holders():  # state made at construction (Adagrad's ``sum``)
                t = holder.get()
                host_scalar = t.dim() == 0 and t.is_cpu
                if t.device != self.torch_device and not host_scalar:
                    holder.set(t.to(self.torch_device))

    def _model_holders(self) -> Iterator[TensorHolder]:
        if self._storage is None:
            return module_holders(_unwrap(self.module))
        return self._ddp_holders()

    def _ddp_holders(self) -> Iterator[TensorHolder]:
        inner = _unwrap(self.module)
        for name, param in inner.named_parameters():
            yield storage_holder(("param", name), param, self._storage)
        for name, buf in inner.named_buffers():
            yield data_holder(("buffer", name), buf)

    def _grad_holders(self) -> Iterator[TensorHolder]:
        return module_grad_holders(_unwrap(self.module))

    def _optimizer_holders(self) -> Iterator[TensorHolder]:
        return optimizer_holders(self.optimizer) if self.optimizer is not None else iter(())

    def _per_tensor_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` in ``state_dict`` order: detached views of the live storage, unprefixed names.

        EngineStateError while a DDP engine is offloaded.
        """
        if self._storage is not None and self._storage.host:
            raise EngineStateError("this DDP engine's parameters are offloaded (device storage freed); "
                                   f"call to({self.device.kind!r}) before reading them")
        yield from _unwrap(self.module).state_dict().items()
