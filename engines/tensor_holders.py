"""Tensor holders: each a named place holding a tensor an engine may move (parameter, gradient, state entry).

A holder swaps the bytes while the objects users hold keep their identity: a parameter's ``.data``, an
optimizer-state dict entry, a DTensor's local shard. ``param.data = host_tensor`` needs torch's
``_has_compatible_shallow_copy_type`` to accept the pair (the Ascend plugin and npu-sim register it).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Hashable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hal import torch_compat


@dataclasses.dataclass(frozen=True)
class TensorHolder:
    """A place holding one tensor.

    ``key`` is stable for the place (reuses its host buffer); ``get`` returns the tensor holding the bytes, or
    ``None`` when empty; ``set`` puts a replacement in; ``load``, if given, does the onload copy itself.
    """

    key: Hashable
    get: Callable[[], torch.Tensor | None]
    set: Callable[[torch.Tensor], None]
    load: Callable[[torch.Tensor, torch.device, bool], None] | None = None


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """Return the tensor holding ``t``'s bytes on this rank: a DTensor's local shard, else ``t.data``."""
    if isinstance(t, DTensor):
        return torch_compat.dtensor_local(t)
    return t.data


def set_local_tensor(t: torch.Tensor, new: torch.Tensor) -> None:
    """Make ``t`` hold ``new``'s bytes while keeping the Python object ``t``."""
    if isinstance(t, DTensor):
        torch_compat.set_dtensor_local(t, new)  # the wrapper keeps its metadata; only this rank's storage changes
    else:
        t.data = new


def data_holder(key: Hashable, tensor: torch.Tensor) -> TensorHolder:
    """Return a holder for a parameter or buffer, moved by swapping its storage (identity kept)."""
    return TensorHolder(key, lambda: local_tensor(tensor), lambda new: set_local_tensor(tensor, new))


class FreedStorages:
    """Host copies of tensors whose device storage was freed in place (see :func:`storage_holder`)."""

    def __init__(self) -> None:
        self.host: dict[Hashable, torch.Tensor] = {}
        self.nbytes: dict[Hashable, int] = {}


def _owns_storage(t: torch.Tensor) -> bool:
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _storage_set(key: Hashable, tensor: torch.Tensor, holder: FreedStorages, new: torch.Tensor) -> None:
    from engines.errors import EngineStateError

    if not new.is_cpu or tensor.is_cpu:
        raise EngineStateError(f"{key}: a storage holder only offloads a device tensor to the host, got {new.device}")
    if not _owns_storage(tensor.data):
        raise EngineStateError(
            f"{key}: cannot free a tensor that shares its storage (offset {tensor.storage_offset()}, storage "
            f"{tensor.untyped_storage().nbytes()} bytes for {tensor.numel() * tensor.element_size()})")
    holder.nbytes[key] = tensor.untyped_storage().nbytes()
    holder.host[key] = new
    tensor.untyped_storage().resize_(0)


def _storage_load(key: Hashable, tensor: torch.Tensor, holder: FreedStorages, host: torch.Tensor,
                  device: torch.device, non_blocking: bool) -> None:
    tensor.untyped_storage().resize_(holder.nbytes.pop(key))
    with torch.no_grad():
        tensor.data.copy_(host, non_blocking=non_blocking)
    del holder.host[key]


def storage_holder(key: Hashable, tensor: torch.Tensor, holder: FreedStorages) -> TensorHolder:
    """Return a holder that offloads by freeing ``tensor``'s device storage in place (``resize_(0)``).

    The ``TensorImpl`` and its gradient accumulator (DDP's hooks) survive; the tensor must own its whole storage
    and must not be read while offloaded.
    """
    return TensorHolder(key,
                lambda: holder.host.get(key, tensor.data),
                lambda new: _storage_set(key, tensor, holder, new),
                lambda host, device, nb: _storage_load(key, tensor, holder, host, device, nb))


def _grad_get(param: nn.Parameter) -> torch.Tensor | None:
    return None if param.grad is None else local_tensor(param.grad)


def _grad_set(param: nn.Parameter, new: torch.Tensor) -> None:
    # ``param.grad = new`` would be refused when the parameter stays on another device (grad=False moves),
    # so the gradient tensor keeps its identity and takes the new storage.
    set_local_tensor(param.grad, new)


def grad_holder(key: Hashable, param: nn.Parameter) -> TensorHolder:
    """Return a holder for ``param.grad``; empty while the parameter has no gradient."""
    return TensorHolder(key, lambda: _grad_get(param), lambda new: _grad_set(param, new))


def module_holders(module: nn.Module) -> Iterator[TensorHolder]:
    """Yield one holder per distinct parameter, then per distinct buffer (tied weights once)."""
    for name, param in module.named_parameters():
        yield data_holder(("param", name), param)
    for name, buf in module.named_buffers():
        yield data_holder(("buffer", name), buf)


def module_grad_holders(module: nn.Module) -> Iterator[TensorHolder]:
    """Yield one gradient holder per distinct parameter, in ``named_parameters`` order."""
    for name, param in module.named_parameters():
        yield grad_holder(("grad", name), param)


def _state_get(state: dict, k: Hashable) -> torch.Tensor:
    return local_tensor(state[k])


def _state_set(state: dict, k: Hashable, new: torch.Tensor) -> None:
    value = state[k]
    if isinstance(value, DTensor):
        torch_compat.set_dtensor_local(value, new)
    else:
        state[k] = new


def optimizer_holders(optimizer: torch.optim.Optimizer) -> Iterator[TensorHolder]:
    """Yield one holder per tensor of the optimizer's per-parameter state, keyed ``("optim", i, state_key)``."""
    i = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if state:
                for k in list(state):
                    if isinstance(state[k], torch.Tensor):
                        yield TensorHolder(("optim", i, k),
                                   lambda s=state, k=k: _state_get(s, k),
                                   lambda new, s=state, k=k: _state_set(s, k, new))
            i += 1
