"""FSDPEngine: FSDP2 (``fully_shard``) training whose offload moves this rank's shards.

Each FSDP2 parameter is a ``DTensor`` whose bytes live in one padded flat tensor per parameter
(``FSDPParam._sharded_param_data``) that the DTensor's local tensor views. Offload swaps that flat tensor for
a host buffer and points the local tensor at it, which is what FSDP2's own ``reset_sharded_param`` expects
after a move (torch 2.13, ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``); these internals are
reached only through :mod:`hal.torch_compat`. Gradients and optimizer states are DTensors too; their
local shards move (see :mod:`engines.tensor_holders`).

FSDP2 runs on gloo with a CPU device mesh in torch 2.13, so the cpu kind can train it (where offload moves
nothing); on accelerators the mesh is of the kind's device type and the kind's backend is used.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import hal
from hal import torch_compat
from engines.base import BaseEngine
from engines.errors import EngineStateError
from engines.tensor_holders import TensorHolder, data_holder, module_grad_holders, optimizer_holders


class FSDPEngine(BaseEngine):
    """A module sharded with FSDP2 ``fully_shard`` over a 1-D device mesh, plus its optimizer.

    Args:
        module: the model, built on any device; it is moved to ``device`` and sharded in place.
        optimizer_factory: ``params -> Optimizer``, called on the sharded parameters (DTensors), or
            ``None`` for a forward-only engine.
        device: kind name, ``torch.device`` or spec; ``None`` resolves through ``hal``.
        mesh: the device mesh to shard over; default a 1-D mesh of the kind's device type over the default
            process group's ``world_size`` ranks.
        shard: submodule classes to wrap with their own ``fully_shard`` (e.g. transformer blocks) before the
            root; default none (the root alone, one all-gather per step).
        mp_policy: FSDP2's ``MixedPrecisionPolicy`` for every unit (e.g. verl's default for its FSDP actor:
            ``param_dtype=torch.bfloat16, reduce_dtype=torch.float32``: bf16 all-gathers and compute, fp32
            master shards and gradient reduction); ``None``: compute in the parameters' dtype.

    A module on the meta device (built under ``torch.device("meta")``) is sharded first and then materialised
    on the device with ``to_empty``, so each rank allocates only its own shards (FSDP2's meta-device
    initialisation, as in torch's ``fully_shard`` documentation): its values are uninitialised, and
    non-persistent buffers must be recomputed by the caller.

    Raises:
        EngineStateError: the default process group is not initialized (``hal.init_process_group()``).

    Collective calls (every rank must make them, in the same order): construction, ``train_step``,
    ``get_per_tensor_param``. ``to()`` and ``tensor_home()`` are local to each rank.
    """

    def __init__(self, module: nn.Module, optimizer_factory: Callable[[Iterable[nn.Parameter]],
                 torch.optim.Optimizer] | None = None, device: hal.device.DeviceLike = None,
                 mesh: DeviceMesh | None = None, shard: tuple[type[nn.Module], ...] = (),
                 mp_policy: MixedPrecisionPolicy | None = None):
        if not dist.is_initialized():
            raise EngineStateError("FSDPEngine needs an initialized default process group; call "
                                   "hal.init_process_group() first")
        spec = hal.resolve_device(device)
        on_meta = any(t.is_meta for t in module.parameters())
        if not on_meta:
            module.to(hal.local_device(device))
        if mesh is None:
            mesh = init_device_mesh(spec.name, (dist.get_world_size(),))
        policy = {"mp_policy": mp_policy} if mp_policy is not None else {}
        for sub in list(module.modules()):
            if sub is not module and isinstance(sub, shard):
                fully_shard(sub, mesh=mesh, **policy)
        fully_shard(module, mesh=mesh, **policy)
        if on_meta:  # the shards only: FSDP2 resets its sharded parameters after the move
            module.to_empty(device=hal.local_device(device))
        self.mesh = mesh
        self._freed_shards: list[tuple[object, torch.device]] = []
        optimizer = optimizer_factory(module.parameters()) if optimizer_factory is not None else None
        super().__init__(module, optimizer, device)

    def reshard(self) -> None:
        """Free every unit's unsharded parameters (FSDP2's ``reshard``), leaving each rank its shards: FSDP2
        keeps the root unit unsharded after a forward, for the backward that a forward-only pass never runs."""
        for sub in self.module.modules():
            if isinstance(sub, FSDPModule):
                sub.reshard()

    def _before_move(self) -> None:
        self.reshard()

    def free_shards(self) -> int:
        """Release the memory of this rank's parameter shards; their values are lost, and the module must not
        be used until :meth:`alloc_shards` (for a copy refilled before each use, e.g. a published bf16 copy of
        another engine's shards). Each shard's flat tensor is swapped for a meta tensor of its size, as
        :meth:`to` swaps it for a host one (a storage resize is not possible for every storage).
        Returns the bytes released. Local to this rank."""
        freed = 0
        for fp in torch_compat.fsdp_params(self.module):
            data = torch_compat.fsdp_sharded_data(fp)
            if not data.is_meta:
                self._freed_shards.append((fp, data.device))
                freed += data.numel() * data.element_size()
                torch_compat.set_fsdp_sharded_data(fp, torch.empty_like(data, device="meta"))
        return freed

    def alloc_shards(self) -> None:
        """Give the shards :meth:`free_shards` released new memory on their device (uninitialised values); the
        parameters' DTensors are the same objects, each viewing its new local shard."""
        for fp, device in self._freed_shards:
            data = torch_compat.fsdp_sharded_data(fp)
            torch_compat.set_fsdp_sharded_data(fp, torch.empty_like(data, device=device))
        self._freed_shards = []

    def _model_holders(self) -> Iterator[TensorHolder]:
        names = {id(p): n for n, p in self.module.named_parameters()}
        for fp in torch_compat.fsdp_params(self.module):
            name = names.get(id(torch_compat.fsdp_sharded_param(fp)), torch_compat.fsdp_param_name(fp))
            yield TensorHolder(("param", name),
                       lambda fp=fp: torch_compat.fsdp_sharded_data(fp),
                       lambda new, fp=fp: torch_compat.set_fsdp_sharded_data(fp, new))
        for name, buf in self.module.named_buffers():
            yield data_holder(("buffer", name), buf)

    def _grad_holders(self) -> Iterator[TensorHolder]:
        return module_grad_holders(self.module)

    def _optimizer_holders(self) -> Iterator[TensorHolder]:
        return optimizer_holders(self.optimizer) if self.optimizer is not None else iter(())

    def _per_tensor_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, full tensor)`` in ``state_dict`` order, each all-gathered (``DTensor.full_tensor``).

        Collective: every rank must iterate to the end. Tensors are on the engine's device, new tensors
        (not views of the shards).

        Raises:
            EngineStateError: parameters are offloaded (gathering needs them on the device).
        """
        if self._offloaded["model"] and not self.device.host_memory:
            raise EngineStateError("parameters are offloaded to cpu; call to(device) before gathering them")
        for name, t in self.module.state_dict().items():
            yield name, (t.full_tensor() if isinstance(t, DTensor) else t)
