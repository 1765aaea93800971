"""Trainer engines whose parameters, gradients and optimizer states move between device and host.

Public names: :class:`BaseEngine` (``to``, ``placement``, ``get_per_tensor_param``, ``train_step``),
:class:`TorchEngine`, :class:`FSDPEngine`, :class:`Placement`, :class:`OffloadError`,
:class:`EngineStateError`, :class:`HostBufferPool`, :func:`pin_memory_supported`, :class:`Slot` (for
engine authors).
"""

from engines.base import BaseEngine
from engines.errors import EngineStateError, OffloadError
from engines.fsdp_engine import FSDPEngine
from engines.host_buffers import HostBufferPool, pin_memory_supported
from engines.placement import Placement
from engines.slots import Slot
from engines.torch_engine import TorchEngine

__all__ = ["BaseEngine", "TorchEngine", "FSDPEngine", "Placement", "OffloadError", "EngineStateError",
           "HostBufferPool", "pin_memory_supported", "Slot"]
