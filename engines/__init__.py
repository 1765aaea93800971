"""Trainer engines whose parameters, gradients and optimizer states move between device and host."""

from engines.base import BaseEngine
from engines.errors import EngineStateError, OffloadError
from engines.fsdp_engine import FSDPEngine
from engines.host_buffers import HostBufferPool, pin_memory_supported
from engines.tensor_home import TensorHome
from engines.tensor_holders import TensorHolder
from engines.torch_engine import TorchEngine

__all__ = ["BaseEngine", "TorchEngine", "FSDPEngine", "TensorHome", "OffloadError", "EngineStateError",
           "HostBufferPool", "pin_memory_supported", "TensorHolder"]
