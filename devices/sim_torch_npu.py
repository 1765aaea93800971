"""hal's npu-sim seen as ``torch_npu``: loaded under that name by :mod:`devices.sim_compat`, never directly.

``torch_npu.npu`` is the sim's ``torch.npu``; the fused operators are those of :mod:`devices.sim_ops`
(each computes its torch_npu definition); ``__hal_sim__`` marks the module as the simulation. What
torch_npu has and the sim does not implement (``profiler``, ``_C``, other fused operators) is absent.
"""

import sys

import torch

from devices import sim, sim_compat, sim_ops

sim.register()

__version__ = sim_compat.VERSION
__hal_sim__ = True
npu = torch.npu
globals().update(sim_ops.FUSED_OPS)
sys.modules[f"{__name__}.npu"] = torch.npu
