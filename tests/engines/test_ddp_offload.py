"""TorchEngine around DDP in a 2-process group: offload between steps must keep replicas in sync and exact."""

from __future__ import annotations

import pytest
import torch

import hal
from hal.apps.multiprocess import run_multiprocess
from tests.engines.models import loss_for, make_model

pytestmark = pytest.mark.multiprocess
STEPS = 3


def _train_both_ways(rank, kind):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from engines import TorchEngine

    out = {"placements": [], "freed": [], "moved": []}
    memory = hal.get_torch_device(kind)
    for offload in (False, True):
        model = make_model(0).to(hal.get_device(kind))
        ddp = DDP(model)
        engine = TorchEngine(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2), kind)
        for step in range(STEPS):
            engine.train_step(loss_for(100 * rank + step, engine.torch_device))  # different data per rank
            if offload:
                before = memory.memory_allocated()
                engine.to("cpu")
                out["freed"].append(before - memory.memory_allocated())
                out["moved"].append(engine.last_moved_bytes)
                out["placements"].append(engine.tensor_home())
                engine.to(kind)
        out[offload] = {n: t.detach().cpu().numpy().copy() for n, t in engine.get_per_tensor_param()[0]}
    return out


def _ddp_worker(rank, world_size, kind):
    import gc

    import torch.distributed as dist

    hal.init_process_group(kind, timeout=30)
    out = _train_both_ways(rank, kind)
    # DDP's Reducer goes before the group, not after: when the Reducer's destructor drops the gloo group's last
    # reference, the group's destructor joins its worker thread holding the GIL while that thread needs the GIL
    # to free its last work item (torch 2.13; py-spy: Reducer::~Reducer -> ~ProcessGroupGloo -> thread::join).
    # On an error the group is left to the process's exit, for the same reason.
    gc.collect()
    dist.destroy_process_group()
    return out


def test_ddp_offload_between_steps_keeps_replicas_equal_and_exact(hal_device):
    """DDP's reducer hooks each parameter's gradient accumulator; a plain ``param.data = cpu_tensor``
    offload replaces it and DDP silently stops averaging (this test failed that way before storage holders)."""
    results = run_multiprocess(_ddp_worker, 2, hal_device, timeout=100)
    names = list(make_model(0).state_dict())
    spec = hal.resolve_device(hal_device)
    for rank in (0, 1):
        where = results[rank]["placements"]
        assert len(where) == STEPS
        if spec.host_memory:
            assert results[rank]["moved"] == [0] * STEPS
        else:
            assert all(w.model == w.grad == w.optimizer == "cpu" for w in where), where
            assert all(f >= m > 0 for f, m in zip(results[rank]["freed"], results[rank]["moved"]))
        assert list(results[rank][True]) == names  # no DDP "module." prefix
        for name in names:
            plain, offloaded = results[rank][False][name], results[rank][True][name]
            assert (plain == offloaded).all(), (rank, name)
            assert (results[0][True][name] == results[1][True][name]).all(), name  # gradients were averaged
