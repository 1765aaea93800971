"""FSDPEngine in a 2-process group: offload of local shards, exactness for every flag combination.

One engine cycles through the valid flag combinations, one per step (offload then onload between steps),
while a reference engine trains without offload; any inexact round trip would show in the final weights.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import hal
from hal.testing import run_multiprocess
from tests.engines.models import host_copy, loss_for, make_model

pytestmark = pytest.mark.multiprocess

FLAGS = list(itertools.product([True, False], repeat=3))
VALID = [f for f in FLAGS if not (f[2] and not f[0])]


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _fsdp_worker(rank, world_size, port, kind):
    import torch.distributed as dist

    from engines import FSDPEngine, OffloadError

    hal.init_process_group(kind, timeout=30)
    try:
        memory = hal.get_torch_device(kind)
        reference = FSDPEngine(make_model(0), _adamw, device=kind)
        engine = FSDPEngine(make_model(0), _adamw, device=kind)
        out = {"raised": [], "steps": [], "reports_memory": memory.memory_allocated() > 0}
        for model, optimizer, grad in FLAGS:
            if grad and not model:
                try:
                    engine.to("cpu", model=model, optimizer=optimizer, grad=grad)
                except OffloadError:
                    out["raised"].append((model, optimizer, grad))
        for step, flags in enumerate(VALID):
            reference.train_step(loss_for(step, reference.torch_device))
            engine.train_step(loss_for(step, engine.torch_device))
            before = memory.memory_allocated()
            engine.to("cpu", *flags)
            out["steps"].append((flags, engine.tensor_home(), engine.last_moved_bytes,
                                 before - memory.memory_allocated()))
            engine.to(kind, *flags)
        identity = all(a is b for a, b in zip(engine.module.parameters(), engine.optimizer.param_groups[0]["params"]))
        expected, got = host_copy(reference.get_per_tensor_param()[0]), host_copy(engine.get_per_tensor_param()[0])
        out["identity"] = identity
        out["equal"] = list(got) == list(expected) and all(torch.equal(got[n], expected[n]) for n in got)
        # tensors would travel through shared memory that dies with this process: send numpy arrays
        out["full"] = {n: t.numpy() for n, t in got.items()}
        return out
    finally:
        dist.destroy_process_group()


def test_fsdp_offload_between_steps_is_exact_for_every_flag_combination(hal_device):
    results = run_multiprocess(_fsdp_worker, 2, hal_device, timeout=110)
    spec = hal.resolve_device(hal_device)
    # the unsharded reference: same data on both ranks, so FSDP's averaged gradient equals the local one
    from engines import TorchEngine

    model = make_model(0)
    single = TorchEngine(model, _adamw(model.parameters()), "cpu")
    for step in range(len(VALID)):
        single.train_step(loss_for(step, single.torch_device))
    unsharded = host_copy(single.get_per_tensor_param()[0])
    for rank in (0, 1):
        r = results[rank]
        assert r["raised"] == [f for f in FLAGS if f[2] and not f[0]]
        assert r["equal"] and r["identity"]
        full = {n: torch.from_numpy(a) for n, a in r["full"].items()}
        assert list(full) == list(unsharded)
        for name in full:
            # close, not bit-equal: sharded reduction order differs; the offload guarantee is r["equal"] above
            torch.testing.assert_close(full[name], unsharded[name], rtol=1e-5, atol=1e-6, msg=name)
        assert [flags for flags, *_ in r["steps"]] == VALID
        for (model_f, optimizer_f, grad_f), where, moved, freed in r["steps"]:
            combo = (model_f, optimizer_f, grad_f)
            if spec.host_memory:
                assert moved == 0 and where.model == where.optimizer == where.grad == "cpu", combo
                continue
            assert where.model == ("cpu" if model_f else spec.name), combo
            assert where.grad == ("cpu" if grad_f else spec.name), combo
            assert where.optimizer == ("cpu" if optimizer_f else spec.name), combo
            assert (moved > 0) == (model_f or optimizer_f), combo
            if r["reports_memory"]:
                assert freed >= moved, combo
