"""hal's npu-sim seen as ``torch_npu``: loaded under that name by :mod:`devices.npu_sim.compat`, never directly.

``torch_npu.npu`` is the sim's ``torch.npu``; the fused operators are :mod:`devices.npu_sim.ops`'s.
"""

import sys

import torch

from devices import npu_sim
from devices.npu_sim import compat, ops

npu_sim.register()

__version__ = compat.VERSION
__hal_sim__ = True
npu = torch.npu
globals().update(ops.FUSED_OPS)
sys.modules[f"{__name__}.npu"] = torch.npu
