"""Every private torch name the project touches, each behind one small accessor.

A torch upgrade that renames one breaks here and in ``tests/devices/test_torch_compat.py``, which names the
versions each was checked on (:data:`CHECKED_ON`). It sits in ``devices`` because the simulated npu needs
some of these names; FSDP2 and DTensor modules are imported lazily.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, Iterator, NamedTuple

import torch
import torch.distributed as dist

# torch releases checked: 2.13.0 by running tests/devices/test_torch_compat.py, 2.14.0 against its source.
CHECKED_ON: tuple[str, ...] = ("2.13.0", "2.14.0")


# -- DTensor --------------------------------------------------------------------------------------------

def dtensor_local(t: torch.Tensor) -> torch.Tensor:
    """Return the local shard a ``DTensor`` wraps (``_local_tensor``): the stored tensor, not a view."""
    return t._local_tensor


def set_dtensor_local(t: torch.Tensor, new: torch.Tensor) -> None:
    """Make ``DTensor`` ``t`` wrap ``new`` (same shape and dtype) as its local shard, keeping its placements."""
    t._local_tensor = new


# -- FSDP2 (fully_shard) internals ----------------------------------------------------------------------

def fsdp_params(module: torch.nn.Module) -> Iterator[Any]:
    """Yield every FSDP2 ``FSDPParam`` under ``module``, one per sharded parameter, module by module.

    Reads ``_fsdp_param_groups`` (plural: the singular property raises once parameters span several meshes).
    """
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            for group in sub._get_fsdp_state()._fsdp_param_groups:
                yield from group.fsdp_params


def fsdp_param_name(fsdp_param: Any) -> str:
    """Return the parameter's name relative to the module that owns it (``FSDPParam._module_info.param_name``)."""
    return fsdp_param._module_info.param_name


def fsdp_sharded_param(fsdp_param: Any) -> torch.Tensor:
    """Return the ``DTensor`` parameter the user's module holds (``FSDPParam.sharded_param``)."""
    return fsdp_param.sharded_param


def fsdp_sharded_data(fsdp_param: Any) -> torch.Tensor:
    """Return the padded flat tensor holding this rank's shard (``_sharded_param_data``); the DTensor views it."""
    return fsdp_param._sharded_param_data


def set_fsdp_sharded_data(fsdp_param: Any, new: torch.Tensor) -> None:
    """Make ``fsdp_param`` hold its padded shard in ``new`` (1-D, same numel and dtype, any device).

    Points its DTensor's local tensor at the unpadded part, as FSDP2's ``reset_sharded_param`` expects.
    """
    sharded = fsdp_param.sharded_param
    dim = fsdp_param.fsdp_placement.dim
    length = dtensor_local(sharded).size(dim)
    fsdp_param._sharded_param_data = new
    set_dtensor_local(sharded, new.view(fsdp_param.padded_sharded_param_size).narrow(dim, 0, length))


# -- torch.distributed (c10d) ---------------------------------------------------------------------------

class BackendPlugin(NamedTuple):
    """A backend registered with ``Backend.register_backend``: its creator and whether it takes the extended API."""

    creator_fn: Callable[..., Any]
    extended_api: bool


def registered_backend_plugins() -> list[str]:
    """Return the upper-case names of backends registered through ``Backend.register_backend``.

    From torch 2.14 torch's own backends appear here too once a group of theirs was made.
    """
    return sorted(dist.Backend._plugins)


def backend_plugin(name: str) -> BackendPlugin | None:
    """Return the registered plugin backend ``name`` (any case), or ``None``.

    On torch 2.14 an entry-point backend is registered first; RuntimeError if that fails.
    """
    ensure = getattr(dist.Backend, "_ensure_backend_registered", None)
    if ensure is not None:
        ensure(name)
    plugin = dist.Backend._plugins.get(name.upper())
    return None if plugin is None else BackendPlugin(plugin.creator_fn, bool(plugin.extended_api))


def extended_backend_options(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta,
                             group_id: str) -> Any:
    """Return the ``_DistributedBackendOptions`` an ``extended_api`` creator takes, for ranks ``0..world_size-1``."""
    opts = dist.distributed_c10d._DistributedBackendOptions()
    opts.store, opts.group_rank, opts.group_size, opts.timeout = store, rank, world_size, timeout
    opts.group_id = group_id
    opts.global_ranks_in_group = list(range(world_size))
    return opts


def nccl_options(timeout: datetime.timedelta) -> Any:
    """Return ``ProcessGroupNCCL.Options`` carrying ``timeout``; AttributeError on builds without NCCL."""
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return opts


# The base class of a Python-implemented collective's work object.
Work = dist._Work


def use_count(t: torch.Tensor) -> int:
    """Return how many C++ references hold ``t``'s ``TensorImpl`` (1 when only Python holds it)."""
    return t._use_count()


def register_group_backend(group: dist.ProcessGroup, device: torch.device, backend: Any) -> None:
    """Register ``backend`` as the custom backend serving ``device``'s tensors in a Python ``ProcessGroup``."""
    group._register_backend(device, dist.ProcessGroup.BackendType.CUSTOM, backend)


# -- PrivateUse1 (out-of-tree devices) ------------------------------------------------------------------

def privateuse1_backend_name() -> str:
    """Return the current name of the PrivateUse1 dispatch key (``"privateuseone"`` until a rename)."""
    return torch._C._get_privateuse1_backend_name()


def register_device_module(name: str, module: Any) -> None:
    """Install ``module`` as ``torch.<name>`` (what torch_npu does); RuntimeError if it already exists."""
    torch._register_device_module(name, module)


__all__ = [
    "CHECKED_ON", "dtensor_local", "set_dtensor_local", "fsdp_params", "fsdp_param_name", "fsdp_sharded_param",
    "fsdp_sharded_data", "set_fsdp_sharded_data", "BackendPlugin", "registered_backend_plugins",
    "backend_plugin", "extended_backend_options", "nccl_options", "Work", "use_count", "register_group_backend",
    "privateuse1_backend_name", "register_device_module",
]
