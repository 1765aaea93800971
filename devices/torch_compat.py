"""Every private torch name the project touches, each behind one small accessor.

torch keeps no promise about names that start with an underscore, nor about the classes of its private
modules (FSDP2's ``FSDPParam`` lives in ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``). Code in
``hal``, ``engines``, ``ckpt`` and ``devices`` reaches them only through this module, so that a torch
upgrade that renames one breaks here, in one file, and in ``tests/devices/test_torch_compat.py``, whose
tests exercise each accessor and name the torch versions it was checked on (:data:`CHECKED_ON`).

Where: this module sits in ``devices``, the bottom package, because ``devices`` itself needs some of these
names (the simulated npu registers a PrivateUse1 device and a Python collective backend) and imports
nothing from ``hal``; ``hal`` and ``engines`` import it from here (imports point down). It imports
only torch, and the FSDP2 and DTensor modules lazily, inside the accessors that need them, so importing
it costs nothing beyond ``import torch``.

Nothing here knows a device kind: the NCCL options accessor is the one exception, used by the cuda kind.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, Iterator, NamedTuple

import torch
import torch.distributed as dist

CHECKED_ON: tuple[str, ...] = ("2.13.0", "2.14.0")
"""torch releases each accessor below was checked on: 2.13.0 by running ``tests/devices/test_torch_compat.py``,
2.14.0 against that release's source (the modules named in each accessor, read side by side with 2.13.0's;
what differs is handled in the accessor and said in its doc)."""


# -- DTensor --------------------------------------------------------------------------------------------

def dtensor_local(t: torch.Tensor) -> torch.Tensor:
    """The local shard a ``DTensor`` wraps (``DTensor._local_tensor``), the tensor that holds this rank's
    bytes; unlike the public ``to_local()`` it is the stored object itself, not a view with autograd."""
    return t._local_tensor


def set_dtensor_local(t: torch.Tensor, new: torch.Tensor) -> None:
    """Make the ``DTensor`` ``t`` wrap ``new`` (same shape and dtype) as its local shard, keeping the wrapper
    object, its placements and its mesh (``DTensor._local_tensor`` assignment)."""
    t._local_tensor = new


# -- FSDP2 (fully_shard) internals ----------------------------------------------------------------------

def fsdp_params(module: torch.nn.Module) -> Iterator[Any]:
    """Every FSDP2 ``FSDPParam`` under ``module``, one per sharded parameter, module by module.

    Reads ``FSDPModule._get_fsdp_state()._fsdp_param_groups[*].fsdp_params`` (torch 2.13 and 2.14); a
    module without parameters of its own has no group and contributes nothing. The plural list, not the
    singular ``_fsdp_param_group``: that one is a backward-compatibility property which raises once a
    ``shard_placement_fn`` puts one module's parameters on several meshes (several groups).
    """
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            for group in sub._get_fsdp_state()._fsdp_param_groups:
                yield from group.fsdp_params


def fsdp_param_name(fsdp_param: Any) -> str:
    """The parameter's name relative to the module that owns it (``FSDPParam._module_info.param_name``)."""
    return fsdp_param._module_info.param_name


def fsdp_sharded_param(fsdp_param: Any) -> torch.Tensor:
    """The ``DTensor`` parameter the user's module holds (``FSDPParam.sharded_param``)."""
    return fsdp_param.sharded_param


def fsdp_sharded_data(fsdp_param: Any) -> torch.Tensor:
    """The padded flat (1-D) tensor that holds this rank's shard (``FSDPParam._sharded_param_data``); the
    DTensor's local tensor is a view of it."""
    return fsdp_param._sharded_param_data


def set_fsdp_sharded_data(fsdp_param: Any, new: torch.Tensor) -> None:
    """Make ``fsdp_param`` hold its padded shard in ``new`` (1-D, same numel and dtype, any device) and point
    its DTensor's local tensor at the unpadded part of it, as FSDP2's ``reset_sharded_param`` expects after a
    move (reads ``fsdp_placement.dim``, ``padded_sharded_param_size``; writes ``_sharded_param_data`` and
    the DTensor's ``_local_tensor``)."""
    sharded = fsdp_param.sharded_param
    dim = fsdp_param.fsdp_placement.dim
    length = dtensor_local(sharded).size(dim)
    fsdp_param._sharded_param_data = new
    set_dtensor_local(sharded, new.view(fsdp_param.padded_sharded_param_size).narrow(dim, 0, length))


# -- torch.distributed (c10d) ---------------------------------------------------------------------------

class BackendPlugin(NamedTuple):
    """A backend registered with ``Backend.register_backend``: its creator and whether it takes the
    extended API (one ``_DistributedBackendOptions`` argument) or ``(store, rank, size, timeout)``."""

    creator_fn: Callable[..., Any]
    extended_api: bool


def registered_backend_plugins() -> list[str]:
    """Upper-case names of the backends registered through ``Backend.register_backend`` (``Backend._plugins``).

    From torch 2.14 torch registers its own backends (gloo, nccl, ...) through ``register_backend`` too, on
    first use, so they appear here once a group of theirs was made; before 2.14 only third-party ones do.
    """
    return sorted(dist.Backend._plugins)


def backend_plugin(name: str) -> BackendPlugin | None:
    """The registered plugin backend ``name`` (any case), or ``None`` when none is registered under it.

    From torch 2.14 a backend may also be offered through the ``torch.distributed.backends`` entry-point
    group and registered only when first asked for (``Backend._ensure_backend_registered``, which
    ``init_process_group`` calls); this asks the same way first, so such a backend is found here too.

    Raises:
        RuntimeError: (torch 2.14) the entry point offering ``name`` fails to load or registers nothing.
    """
    ensure = getattr(dist.Backend, "_ensure_backend_registered", None)
    if ensure is not None:
        ensure(name)
    plugin = dist.Backend._plugins.get(name.upper())
    return None if plugin is None else BackendPlugin(plugin.creator_fn, bool(plugin.extended_api))


def extended_backend_options(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta,
                             group_id: str) -> Any:
    """The single argument an ``extended_api`` creator takes (``distributed_c10d._DistributedBackendOptions``),
    for a group of ranks ``0 .. world_size - 1`` named ``group_id``."""
    opts = dist.distributed_c10d._DistributedBackendOptions()
    opts.store, opts.group_rank, opts.group_size, opts.timeout = store, rank, world_size, timeout
    opts.group_id = group_id
    opts.global_ranks_in_group = list(range(world_size))
    return opts


def nccl_options(timeout: datetime.timedelta) -> Any:
    """``ProcessGroupNCCL.Options`` carrying ``timeout`` (its ``_timeout`` field; torch has no public setter).

    Raises:
        AttributeError: this torch build has no NCCL (``ProcessGroupNCCL`` is absent from CPU builds).
    """
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return opts


Work = dist._Work
"""The base class of a Python-implemented collective's work object (``torch.distributed._Work``)."""


def use_count(t: torch.Tensor) -> int:
    """How many C++ references hold ``t``'s ``TensorImpl`` (``Tensor._use_count()``): 1 for a tensor only
    Python holds, more while a C++ object (a collective's work, a view's base pointer) keeps it."""
    return t._use_count()


def register_group_backend(group: dist.ProcessGroup, device: torch.device, backend: Any) -> None:
    """Tell a Python ``ProcessGroup`` subclass which backend object serves ``device``'s tensors, as a custom
    backend (``ProcessGroup._register_backend(device, BackendType.CUSTOM, backend)``); C++ callers look a
    backend up per device."""
    group._register_backend(device, dist.ProcessGroup.BackendType.CUSTOM, backend)


# -- PrivateUse1 (out-of-tree devices) ------------------------------------------------------------------

def privateuse1_backend_name() -> str:
    """The current name of the PrivateUse1 dispatch key (``"privateuseone"`` until a rename)."""
    return torch._C._get_privateuse1_backend_name()


def register_device_module(name: str, module: Any) -> None:
    """Install ``module`` as ``torch.<name>`` (``torch._register_device_module``, what torch_npu calls).

    Raises:
        RuntimeError: ``torch.<name>`` already exists.
    """
    torch._register_device_module(name, module)


__all__ = [
    "CHECKED_ON", "dtensor_local", "set_dtensor_local", "fsdp_params", "fsdp_param_name", "fsdp_sharded_param",
    "fsdp_sharded_data", "set_fsdp_sharded_data", "BackendPlugin", "registered_backend_plugins",
    "backend_plugin", "extended_backend_options", "nccl_options", "Work", "use_count", "register_group_backend",
    "privateuse1_backend_name", "register_device_module",
]
