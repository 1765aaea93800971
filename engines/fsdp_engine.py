"""FSDPEngine: FSDP2 (``fully_shard``) training whose offload moves this rank's shards.

Offload swaps each parameter's padded flat shard (``_sharded_param_data``, through :mod:`hal.torch_compat`)
for a host buffer and points the DTensor's local tensor at it, as FSDP2's ``reset_sharded_param`` expects.
The cpu kind runs FSDP2 on gloo; accelerators use the kind's device mesh and backend.
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

    ``optimizer_factory`` takes the sharded parameters; ``shard``: submodule classes wrapped before the root;
    ``mp_policy``: FSDP2's ``MixedPrecisionPolicy``. A meta-device module is sharded, then materialised with
    ``to_empty`` (values uninitialised). Construction, ``train_step`` and ``get_per_tensor_param`` are
    collective; ``to()`` and ``tensor_home()`` are local. EngineStateError without a default process group.
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
            module.to(hal.get_device(device))
        if mesh is None:
            mesh = init_device_mesh(spec.name, (dist.get_world_size(),))
        policy = {"mp_policy": mp_policy} if mp_policy is not None else {}
        for sub in list(module.modules()):
            if sub is not module and isinstance(sub, shard):
                fully_shard(sub, mesh=mesh, **policy)
        fully_shard(module, mesh=mesh, **policy)
        if on_meta:  # the shards only: FSDP2 resets its sharded parameters after the move
            module.to_empty(device=hal.get_device(device))
        self.mesh = mesh
        self._freed_shards: list[tuple[object, torch.device]] = []
        optimizer = optimizer_factory(module.parameters()) if optimizer_factory is not None else None
        super().__init__(module, optimizer, device)

    def reshard(self) -> None:
        """Free every unit's unsharded parameters (FSDP2's ``reshard``); a forward leaves the root unsharded."""
        for sub in self.module.modules():
            if isinstance(sub, FSDPModule):
                sub.reshard()

    def _before_move(self) -> None:
        self.reshard()

    def free_shards(self) -> int:
        """Release this rank's parameter shards (values lost until :meth:`alloc_shards`); return the bytes released."""
        freed = 0
        for fp in torch_compat.fsdp_params(self.module):
            data = torch_compat.fsdp_sharded_data(fp)
            if not data.is_meta:
                self._freed_shards.append((fp, data.device))
                freed += data.numel() * data.element_size()
                torch_compat.set_fsdp_sharded_data(fp, torch.empty_like(data, device="meta"))
        return freed

    def alloc_shards(self) -> None:
        """Give the shards :meth:`free_shards` released new, uninitialised memory on their device."""
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
        """Yield ``(name, full tensor)`` in ``state_dict`` order, each all-gathered: every rank must iterate to the end.

        Tensors are new, on the engine's device; EngineStateError while parameters are offloaded.
        """
        if self._offloaded["model"] and not self.device.host_memory:
            raise EngineStateError("parameters are offloaded to cpu; call to(device) before gathering them")
        for name, t in self.module.state_dict().items():
            yield name, (t.full_tensor() if isinstance(t, DTensor) else t)
