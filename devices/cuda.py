"""The cuda kind: NVIDIA GPUs through ``torch.cuda``, collectives over NCCL."""

from __future__ import annotations

import dataclasses
import sys
import types

from devices.base import Availability, DeviceSpec, probe_safely


@dataclasses.dataclass(frozen=True)
class CudaDevice(DeviceSpec):
    kind: str = "cuda"
    name: str = "cuda"
    dist_backend: str = "nccl"
    visible_devices_env: str | None = "CUDA_VISIBLE_DEVICES"
    visible_devices_fixed: bool = True  # read by CUDA's first initialisation in the process
    supports_pin_memory: bool = True
    ray_resource: str | None = "GPU"
    nixl_memory_type: str | None = "VRAM"
    mooncake_protocol: str | None = "rdma"

    def torch_module(self) -> types.ModuleType:
        import torch

        return torch.cuda

    def availability(self, device: int | None = None) -> Availability:
        """Return whether torch has CUDA and sees a GPU (and ``device``, if given, is one of them)."""
        return probe_safely(self.kind, self._probe).of_index(self.kind, device)

    def is_set_up(self) -> bool:
        """Return whether CUDA was initialised in this process (it read ``CUDA_VISIBLE_DEVICES`` then)."""
        torch = sys.modules.get("torch")
        return bool(torch is not None and torch.cuda.is_initialized())

    def _probe(self) -> Availability:
        import torch

        if not torch.backends.cuda.is_built():
            return Availability.unavailable(f"torch {torch.__version__} was built without CUDA")
        count = torch.cuda.device_count()
        if count == 0 or not torch.cuda.is_available():
            return Availability.unavailable("torch.cuda.is_available() is False (no driver or no GPU visible)")
        return Availability.available(count)

    def ipc_transport(self) -> str:
        """Return ``"device"``: CUDA IPC through torch's ``reduce_tensor``."""
        return "device"

    def share_device_buffer(self, nbytes: int, device):
        """Return a GPU buffer exported with torch's ``reduce_tensor``."""
        from devices.ipc import share_with_torch

        return share_with_torch(nbytes, device)

    def create_backend(self, store, rank: int, world_size: int, timeout):
        """Return a ``ProcessGroupNCCL`` over ``store`` whose collectives time out after ``timeout`` (a timedelta)."""
        import torch.distributed as dist

        from devices import torch_compat

        return dist.ProcessGroupNCCL(store, rank, world_size, torch_compat.nccl_options(timeout))


SPEC = CudaDevice()
