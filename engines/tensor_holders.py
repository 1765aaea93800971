"""Tensor holders: each one named place that holds a tensor an engine may move (a parameter, a gradient, a state entry).

A holder reads the tensor that holds the bytes and writes a replacement into the same place, so that the
objects users hold keep their identity: a parameter's ``.data`` is swapped (as ``nn.Module._apply`` does
for plain tensors, and as verl's offload helpers do), an optimizer-state entry is replaced in its dict, and
a DTensor keeps its wrapper while its ``_local_tensor`` (this rank's shard) is swapped.

``param.data = host_tensor`` needs torch's ``_has_compatible_shallow_copy_type`` to accept the pair: true for
CPU and CUDA, and on Ascend because the Ascend plugin registers its own kernel for it (the npu-sim kind
does the same).
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

    Fields:
        key: stable across calls for the same place (e.g. ``("param", "layer.weight")``), used to reuse the
            host buffer of that place and to remember what was offloaded.
        get: returns the tensor holding the bytes (a DTensor's local shard), or ``None`` when empty (a
            parameter without gradient).
        set: puts a replacement tensor (same shape and dtype, possibly another device) into the place.
        load: optional onload ``load(host_tensor, device, non_blocking)`` that copies the host bytes back
            itself; when ``None`` the engine calls ``set(host_tensor.to(device, non_blocking=...))``.
    """

    key: Hashable
    get: Callable[[], torch.Tensor | None]
    set: Callable[[torch.Tensor], None]
    load: Callable[[torch.Tensor, torch.device, bool], None] | None = None


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor that holds ``t``'s bytes on this rank: a DTensor's local shard, else ``t.data``."""
    if isinstance(t, DTensor):
        return torch_compat.dtensor_local(t)
    return t.data


def set_local_tensor(t: torch.Tensor, new: torch.Tensor) -> None:
    """Make ``t`` hold ``new``'s bytes while keeping the Python object ``t`` (see the module docstring)."""
    if isinstance(t, DTensor):
        torch_compat.set_dtensor_local(t, new)  # the wrapper keeps its metadata; only this rank's storage changes
    else:
        t.data = new


def data_holder(key: Hashable, tensor: torch.Tensor) -> TensorHolder:
    """A holder for a parameter or buffer object, moved by swapping its storage (identity kept)."""
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
    """A holder that offloads by freeing ``tensor``'s device storage in place (``resize_(0)``).

    The tensor keeps its device, its ``TensorImpl`` and so its gradient accumulator: hooks registered on
    that accumulator (DDP's reducer) keep firing after an onload. ``param.data = cpu_tensor`` would replace
    the accumulator, since autograd drops it when a tensor changes device. While offloaded the bytes live in
    the host copy ``get()`` returns, and the tensor itself must not be read. FSDP1 frees its flat
    parameters the same way. Requires the tensor to own its whole storage.
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
    """A holder for ``param.grad``; empty while the parameter has no gradient."""
    return TensorHolder(key, lambda: _grad_get(param), lambda new: _grad_set(param, new))


def module_holders(module: nn.Module) -> Iterator[TensorHolder]:
    """One holder per distinct parameter, then per distinct buffer, in ``named_*`` order.

    Tied weights (one ``Parameter`` registered under two names) give one holder, so they stay one object.
    """
    for name, param in module.named_parameters():
        yield data_holder(("param", name), param)
    for name, buf in module.named_buffers():
        yield data_holder(("buffer", name), buf)


def module_grad_holders(module: nn.Module) -> Iterator[TensorHolder]:
    """One gradient holder per distinct parameter, in ``named_parameters`` order."""
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
    """One holder per tensor in the optimizer's per-parameter state, whatever its key.

    Keys are ``("optim", i, state_key)`` with ``i`` the parameter's position across ``param_groups``, so
    they are stable across steps. Non-tensor values (ints, floats) are left alone. An optimizer that has not
    stepped has no state and gives no holder, so offloading it creates nothing.
    """
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
